"""`sdq health`: every part of a working deployment answers; a part that is down is named
and the command exits 1."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, BeatProcess, WorkerProcess
from tests.services import free_port, wait_for

pytestmark = pytest.mark.timeout(300)


def health(env: dict[str, str]) -> tuple[int, dict[str, dict]]:
    done = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "health", "--json"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0)
    return done.returncode, {check["name"]: check for check in report["checks"]}


def test_a_whole_deployment_is_healthy(
    worker: WorkerProcess, cpu_worker: WorkerProcess, service_env: dict[str, str], tmp_path
) -> None:
    env = {**service_env, "SDQ_MAINTENANCE_INTERVAL_SECONDS": "1"}
    code, checks = health(env)
    assert code == 1 and not checks["beat"]["ok"] and "sdq beat" in checks["beat"]["detail"]
    beat = BeatProcess(env, tmp_path / "beat.log").start()
    try:
        wait_for(lambda: health(env)[0] == 0, what="every check to pass", timeout=60)
    finally:
        beat.stop()
    _, checks = health(env)
    assert "wrote, read and deleted a probe" in checks["store"]["detail"]
    assert "schema current" in checks["database"]["detail"]
    assert checks["workers: generate"]["detail"].startswith("cpu-render@")
    assert checks["workers: download"]["detail"].startswith("cpu@")


def test_parts_that_are_down_are_named(service_env: dict[str, str]) -> None:
    env = {
        **service_env,
        "SDQ_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        "SDQ_STORE_URL": "s3://no-such-bucket/sdq",
    }
    code, checks = health(env)
    assert code == 1
    assert checks["database"]["ok"]
    assert not checks["store"]["ok"] and "no-such-bucket" in checks["store"]["detail"]
    assert not checks["broker"]["ok"] and "refused" in checks["broker"]["detail"].lower()
    assert checks["workers: train"] == {
        "name": "workers: train", "ok": False, "detail": "not asked: no broker"
    }  # fmt: skip
