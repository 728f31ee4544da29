"""Starting workers: one process per GPU, each seeing only its own; one that dies is started
again while the others work on; stopping them cleanly."""

import os
import signal
import subprocess
import sys

from sdq.producer.launch import cpu_workers, gpu_workers
from tests.conftest import WorkerProcess
from tests.services import wait_for


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_worker_per_gpu_each_with_its_own_device() -> None:
    commands = gpu_workers(["0", "3"], loglevel="info")
    assert [command.env["CUDA_VISIBLE_DEVICES"] for command in commands] == ["0", "3"]
    for command, gpu in zip(commands, ["0", "3"], strict=True):
        assert command.argv[1:6] == ["-m", "celery", "-A", "sdq.workers.main", "worker"]
        assert option(command.argv, "--queues") == "generate,encode,train"
        assert option(command.argv, "--concurrency") == "1"
        assert option(command.argv, "--prefetch-multiplier") == "1"
        assert option(command.argv, "--hostname") == f"gpu{gpu}@%h"


def test_without_gpus_one_cpu_process_renders() -> None:
    [command] = gpu_workers([], loglevel="info")
    assert command.env["CUDA_VISIBLE_DEVICES"] == ""
    assert option(command.argv, "--hostname") == "cpu-render@%h"
    [pool] = cpu_workers(6, loglevel="warning")
    assert option(pool.argv, "--queues") == "download,maintenance"
    assert option(pool.argv, "--concurrency") == "6"


def test_sigterm_to_the_launcher_stops_every_worker(service_env, tmp_path) -> None:
    process = WorkerProcess(service_env, tmp_path / "worker.log").start()
    group = process.process.pid
    assert len(process.children()) >= 3  # launcher, celery main, its pool process
    os.kill(process.process.pid, signal.SIGTERM)
    assert process.process.wait(60) == 0
    leftover = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
    assert leftover.stdout.split() == []


def test_a_dead_worker_is_started_again_and_its_siblings_keep_working(
    service_env, tmp_path
) -> None:
    env = {**service_env, "SDQ_BROKER_URL": "redis://127.0.0.1:6379/7"}
    log = tmp_path / "launcher.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "worker", "gpu", "--gpus", "0,1"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip

    def workers() -> list[int]:
        listed = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
        return sorted(int(pid) for pid in listed.stdout.split())

    try:
        wait_for(lambda: log.read_text().count("ready.") == 2, what="two workers", timeout=90)
        first, second = workers()
        os.kill(first, signal.SIGKILL)  # one GPU's worker dies
        wait_for(lambda: log.read_text().count("ready.") == 3, what="a restart", timeout=90)
        assert "exited with code -9; starting it again in 2 s" in log.read_text()
        survivors = workers()
        assert second in survivors and first not in survivors and len(survivors) == 2
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(60) == 0
    leftover = subprocess.run(["pgrep", "-g", str(launcher.pid)], capture_output=True, text=True)
    assert leftover.stdout.split() == []
