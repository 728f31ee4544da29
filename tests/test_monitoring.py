"""Flower, as `sdq flower` (and ops/systemd/sdq-flower.service) runs it: every page behind
its credentials, the workers and their queues listed, Prometheus metrics served."""

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sdq.models.jobs.kinds import KINDS, POOL_QUEUES, QUEUES, WARM, Pool
from tests.conftest import ROOT, run_sdq, sdq_json
from tests.services import free_port, listening, wait_for

CREDENTIALS = "ops:correct-horse"


def get(url: str, credentials: str | None = CREDENTIALS) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if credentials:
        token = base64.b64encode(credentials.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.fixture
def flower(service_env: dict[str, str], tmp_path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "flower.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "flower", "--port", str(port)],
        env={**service_env, "FLOWER_BASIC_AUTH": CREDENTIALS},
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(lambda: listening(port), what=f"flower (log: {log})")
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def test_every_page_asks_for_the_credentials(flower: str) -> None:
    for path in ("/", "/workers", "/tasks", "/api/workers", "/api/tasks", "/metrics",
                 "/healthcheck"):  # fmt: skip
        assert get(flower + path, credentials=None)[0] == 401, path
        assert get(flower + path, credentials="ops:wrong")[0] == 401, path
    status, metrics = get(f"{flower}/metrics")
    assert status == 200 and b"flower_" in metrics


def test_flower_lists_the_gpu_worker_and_its_queues(worker, flower: str) -> None:
    found: dict = {}

    def listed() -> bool:
        nonlocal found
        status, body = get(f"{flower}/api/workers?refresh=1")
        found = json.loads(body) if status == 200 else {}
        return any(name.startswith("cpu-render@") for name in found)

    wait_for(listed, what="the worker in flower's list", timeout=30)
    info = next(value for name, value in found.items() if name.startswith("cpu-render@"))
    # The session's worker is shared: beside its pool's queues it may consume the warm
    # queue of work another test left it holding (a train run's ranks).
    queues = {queue["name"] for queue in info["active_queues"] if WARM not in queue["name"]}
    assert queues == set(POOL_QUEUES[Pool.gpu])
    assert "sdq.generate" in info["registered"]
    assert info["stats"]["prefetch_count"] == 1


def test_flower_will_not_start_open_by_accident(service_env: dict[str, str]) -> None:
    refused = run_sdq(service_env, "flower", "--port", str(free_port()), cwd=ROOT, timeout=60)
    assert refused.returncode == 2
    assert "--basic-auth USER:PASSWORD (or set FLOWER_BASIC_AUTH), or --no-auth" in refused.stderr


def test_sdq_metrics_serves_what_flower_does_not(
    worker, service_env: dict[str, str], tmp_path
) -> None:
    prompts = tmp_path / "p.csv"
    prompts.write_text("prompt,seed\nmeasured,1\n")
    sdq_json(service_env, "submit", str(prompts), "--steps", "2", "--wait")
    with metrics_server(service_env) as (port, server):
        # Unless told otherwise, it listens on loopback alone.
        bound = {c.laddr for c in psutil.Process(server.pid).net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN}  # fmt: skip
        assert bound == {("127.0.0.1", port)}
        status, body = get(f"http://127.0.0.1:{port}/metrics", credentials=None)
    assert status == 200
    families = list(text_string_to_metric_families(body.decode()))
    assert {"sdq_lease_expiries", "sdq_retries", "sdq_dead_jobs", "sdq_worker_running_jobs"} <= {
        family.name for family in families
    }
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    queues = {dict(labels)["queue"] for name, labels in samples if name == "sdq_queue_messages"}
    assert queues == set(QUEUES)
    # The setback counters are served from 0, for every kind.
    for counter in ("sdq_lease_expiries_total", "sdq_retries_total", "sdq_dead_jobs_total"):
        assert {dict(labels)["kind"] for name, labels in samples if name == counter} == set(KINDS)
    succeeded = (("kind", "generate"), ("status", "succeeded"))
    assert samples[("sdq_jobs", succeeded)] >= 1
    assert samples[("sdq_outputs_per_second", (("kind", "generate"),))] > 0
    assert samples[("sdq_units_per_second", (("kind", "generate"),))] > 0
    # The worker said what its processes hold (a machine without a GPU: no GPU figures).
    memory = {dict(labels)["worker"]: value for (name, labels), value in samples.items()
              if name == "sdq_worker_memory_bytes"}  # fmt: skip
    assert any(worker.startswith("cpu-render@") for worker in memory), memory  # no GPU here
    assert all(value > 50 * 2**20 for value in memory.values())
    assert not [name for name, _ in samples if name == "sdq_worker_gpu_memory_bytes"]

    # Every metric the Grafana dashboard plots is one sdq serves.
    dashboard = json.loads((ROOT / "ops/grafana/sdq.json").read_text())
    plotted = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        for name in re.findall(r"\b(sdq_[a-z_]+)", target.get("expr", ""))
    }
    # A counter's samples are named <family>_total.
    served = {family.name for family in families} | {
        f"{family.name}_total" for family in families if family.type == "counter"
    }
    assert plotted and plotted <= served, plotted - served


def test_gpu_workers_metrics_give_their_gpus_nvml_readings(service_env, tmp_path) -> None:
    """The workers `sdq worker gpu --train-ranks 1` starts on a machine of two GPUs (the
    train worker on the first, CUDA_VISIBLE_DEVICES=0; the other kinds' on the second),
    with NVML standing in for the driver (tests/stand_in_nvml): each worker's metrics give
    its own GPU alone, the memory its processes hold and the device's, its utilisation,
    temperature and power draw, and no power draw for the board that cannot read it."""
    from sdq.models.settings import Settings
    from sdq.producer.launch import gpu_workers
    from sdq.producer.metrics import SdqCollector
    from sdq.workers.app import create_app

    stand_in = os.pathsep.join(
        [str(ROOT / "tests" / "stand_in_nvml"), os.environ.get("PYTHONPATH", "")]
    )
    processes, logs = [], []
    for n, command in enumerate(gpu_workers(["0", "1"], loglevel="info", ranks=1)):
        logs.append(tmp_path / f"worker{n}.log")
        processes.append(subprocess.Popen(
            command.argv, env={**command.env, **service_env, "PYTHONPATH": stand_in}, cwd=ROOT,
            stdout=logs[-1].open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        ))  # fmt: skip
    host = socket.gethostname()
    nodes = {f"train@{host}": "GPU-0a0a0a0a-0000-0000-0000-000000000000",
             f"gpu1@{host}": "GPU-1b1b1b1b-1111-1111-1111-111111111111"}  # fmt: skip
    app = create_app(Settings.from_env(service_env))
    try:
        for log in logs:
            wait_for(lambda: "ready." in log.read_text(), what=f"log: {log}", timeout=180)  # noqa: B023
        samples = {
            (sample.labels["worker"], sample.name, sample.labels.get("gpu")): sample.value
            for family in SdqCollector(app).collect()
            for sample in family.samples
            if sample.labels.get("worker") in nodes
        }
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    first, second = nodes.values()
    for node, gpu in nodes.items():
        assert {seen for worker, _, seen in samples if worker == node} == {None, gpu}
        assert samples[(node, "sdq_worker_gpu_memory_bytes", gpu)] == 2**30  # its process's
        assert samples[(node, "sdq_gpu_memory_used_bytes", gpu)] == 5 * 2**30  # everyone's
        assert samples[(node, "sdq_gpu_memory_total_bytes", gpu)] == 80 * 2**30
    train, other = nodes
    assert samples[(train, "sdq_gpu_utilization_percent", first)] == 12
    assert samples[(train, "sdq_gpu_temperature_celsius", first)] == 41
    assert samples[(train, "sdq_gpu_power_watts", first)] == 96.5
    assert samples[(other, "sdq_gpu_utilization_percent", second)] == 87
    assert samples[(other, "sdq_gpu_temperature_celsius", second)] == 64
    assert (other, "sdq_gpu_power_watts", second) not in samples


def test_an_idle_worker_is_a_zero_not_a_gap(own_deployment: dict[str, str]) -> None:
    """A worker that finished jobs lately and holds none now scrapes as 0 running jobs."""
    from sdq.models.settings import Settings
    from sdq.producer.metrics import SdqCollector
    from sdq.workers.app import create_app

    with psycopg.connect(own_deployment["SDQ_DATABASE_URL"]) as db:
        [run_id] = db.execute(
            "INSERT INTO runs (kind, options, job_count) VALUES ('generate', '{}', 2) RETURNING id"
        ).fetchone()
        db.execute(
            "INSERT INTO jobs (run_id, kind, spec, spec_hash, status, attempts, worker_host, "
            "device, finished_at, cached) VALUES "
            "(%s, 'generate', '{}', 'a', 'succeeded', 1, 'idle:1', 'cpu', now(), false), "
            "(%s, 'generate', '{}', 'b', 'running', 1, 'busy:2', 'cpu', NULL, false)",
            (run_id, run_id),
        )
    app = create_app(Settings.from_env(own_deployment))
    held = {
        sample.labels["worker"]: sample.value
        for family in SdqCollector(app).collect()
        for sample in family.samples
        if sample.name == "sdq_worker_running_jobs"
    }
    assert held == {"idle:1": 0, "busy:2": 1}


@contextmanager
def metrics_server(env: dict[str, str]) -> Iterator[tuple[int, subprocess.Popen]]:
    """`sdq metrics` as a user starts it: its port and process, once it listens."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "metrics", "--port", str(port)],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(lambda: listening(port), what="sdq metrics")
        yield port, server
    finally:
        server.terminate()
        server.wait(10)


def scraped(env: dict[str, str], names: set[str]) -> dict[tuple, float]:
    """The samples of the named families on one scrape of `sdq metrics`."""
    with metrics_server(env) as (port, _):
        status, body = get(f"http://127.0.0.1:{port}/metrics", credentials=None)
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        if family.name in names
        for sample in family.samples
    }
