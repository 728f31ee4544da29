"""Starting workers: one process per GPU, each seeing only its own; stopping them cleanly."""

import os
import signal
import subprocess

from sdq.producer.launch import cpu_workers, gpu_workers
from tests.conftest import WorkerProcess


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
