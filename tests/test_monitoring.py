"""Flower, as ops/systemd/sdq-flower.service runs it, sees the workers and their queues."""

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT
from tests.services import answers, free_port, wait_for


@pytest.fixture
def flower(service_env: dict[str, str], tmp_path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "flower.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "--app", "sdq.workers.main", "flower", f"--port={port}"],
        env={**service_env, "FLOWER_UNAUTHENTICATED_API": "true"},
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: answers(url), what=f"flower (log: {log})")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def test_flower_lists_the_gpu_worker_and_its_queues(worker, flower: str) -> None:
    def workers() -> dict:
        with urllib.request.urlopen(f"{flower}/api/workers?refresh=1", timeout=10) as response:
            return json.load(response)

    found: dict = {}

    def listed() -> bool:
        nonlocal found
        found = workers()
        return any(name.startswith("cpu-render@") for name in found)

    wait_for(listed, what="the worker in flower's list", timeout=30)
    info = next(value for name, value in found.items() if name.startswith("cpu-render@"))
    queues = {queue["name"] for queue in info["active_queues"]}
    assert queues == {"generate", "encode", "train"}
    assert "sdq.generate" in info["registered"]
    assert info["stats"]["prefetch_count"] == 1
