"""Starting worker processes: plain `celery worker` commands, one per GPU.

The parent never imports torch or touches CUDA; each child sees one GPU through
CUDA_VISIBLE_DEVICES and loads its pipeline on first use.
"""

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

from sdq.models.jobs.kinds import POOL_QUEUES, Pool

CELERY_APP = "sdq.workers.main"


@dataclass(frozen=True)
class WorkerCommand:
    argv: list[str]
    env: dict[str, str]


def visible_gpus() -> list[str]:
    """GPU indices from nvidia-smi, without importing torch; none on a machine without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    listing = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return [line.strip() for line in listing.stdout.splitlines() if line.strip()]


def celery_worker(
    queues: tuple[str, ...], *, name: str, concurrency: int, prefetch: int, loglevel: str
) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", CELERY_APP, "worker",
        "--queues", ",".join(queues),
        "--hostname", f"{name}@%h",
        "--concurrency", str(concurrency),
        "--prefetch-multiplier", str(prefetch),
        "--loglevel", loglevel,
    ]  # fmt: skip


def gpu_workers(gpus: list[str], *, loglevel: str) -> list[WorkerCommand]:
    """One prefork worker of concurrency 1 per GPU: the pipeline loads in the forked child,
    and a child killed mid-task gives its message back to the queue."""
    if not gpus:
        argv = celery_worker(
            POOL_QUEUES[Pool.gpu], name="cpu-render", concurrency=1, prefetch=1, loglevel=loglevel
        )
        return [WorkerCommand(argv, {**os.environ, "CUDA_VISIBLE_DEVICES": ""})]
    return [
        WorkerCommand(
            celery_worker(
                POOL_QUEUES[Pool.gpu],
                name=f"gpu{gpu}",
                concurrency=1,
                prefetch=1,
                loglevel=loglevel,
            ),
            {**os.environ, "CUDA_VISIBLE_DEVICES": gpu},
        )
        for gpu in gpus
    ]


def cpu_workers(concurrency: int, *, loglevel: str) -> list[WorkerCommand]:
    argv = celery_worker(
        POOL_QUEUES[Pool.cpu], name="cpu", concurrency=concurrency, prefetch=4, loglevel=loglevel
    )
    return [WorkerCommand(argv, dict(os.environ))]


def supervise(commands: list[WorkerCommand]) -> int:
    """Runs the workers until one exits or we are told to stop; passes stop signals on.

    Celery's warm shutdown on SIGTERM lets a running batch finish; a second SIGTERM or a
    SIGQUIT stops at once, and acks_late hands the unfinished batch back to the queue.
    """
    children = [subprocess.Popen(command.argv, env=command.env) for command in commands]

    def forward(signum, _frame) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, forward)
    try:
        _, status = os.wait()
    except ChildProcessError:
        status = 0
    forward(signal.SIGTERM, None)
    codes = [child.wait() for child in children]
    return next(
        (code for code in codes if code), os.waitstatus_to_exitcode(status) if status else 0
    )
