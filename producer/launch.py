"""Starting worker processes: plain `celery worker` commands, one per GPU.

The parent never imports torch or touches CUDA; each child sees one GPU through
CUDA_VISIBLE_DEVICES and loads its pipeline on first use.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from sdq.models.jobs.kinds import POOL_QUEUES, TRAIN, Pool

CELERY_APP = "sdq.workers.main"
# A dead worker is started again after 2, 4, 8... seconds, at most this many; one that ran
# longer than that before dying starts the count afresh.
RESTART_BACKOFF_CAP = 60.0
# Deaths in a row, each soon after the start, before the launcher gives up (its own
# supervisor, systemd or Kubernetes, takes it from there).
MAX_QUICK_FAILURES = 5
POLL_SECONDS = 0.5


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


def gpu_workers(
    gpus: list[str],
    *,
    loglevel: str,
    queues: tuple[str, ...] = POOL_QUEUES[Pool.gpu],
    train_ranks: int = 0,
) -> list[WorkerCommand]:
    """One prefork worker of concurrency 1 per GPU: the pipeline loads in the forked child,
    and a child killed mid-task gives its message back to the queue.

    With `train_ranks` R, the first R GPUs are one train worker instead, whose train-shard
    jobs run on up to R rank processes (one per GPU); the other GPUs serve the other queues.
    A GPU that trains never also holds a generation or encode pipeline."""
    commands = []
    if train_ranks:
        group, gpus = gpus[:train_ranks], gpus[train_ranks:]
        argv = celery_worker(
            (TRAIN.queue,), name="train", concurrency=1, prefetch=1, loglevel=loglevel
        )
        commands.append(
            WorkerCommand(argv, {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(group)})
        )
        queues = tuple(queue for queue in queues if queue != TRAIN.queue)
        if not queues or (group and not gpus):
            return commands
    if not gpus:
        argv = celery_worker(
            queues, name="cpu-render", concurrency=1, prefetch=1, loglevel=loglevel
        )
        return [*commands, WorkerCommand(argv, {**os.environ, "CUDA_VISIBLE_DEVICES": ""})]
    return commands + [
        WorkerCommand(
            celery_worker(queues, name=f"gpu{gpu}", concurrency=1, prefetch=1, loglevel=loglevel),
            {**os.environ, "CUDA_VISIBLE_DEVICES": gpu},
        )
        for gpu in gpus
    ]


def cpu_workers(concurrency: int, *, loglevel: str) -> list[WorkerCommand]:
    argv = celery_worker(
        POOL_QUEUES[Pool.cpu], name="cpu", concurrency=concurrency, prefetch=4, loglevel=loglevel
    )
    return [WorkerCommand(argv, dict(os.environ))]


class Supervised:
    """One worker process, started again with backoff when it dies on its own: one GPU's
    crash leaves the others working."""

    def __init__(self, command: WorkerCommand) -> None:
        self.command = command
        self.process = self._start()
        self.quick_failures = 0
        self.restart_at: float | None = None

    def _start(self) -> subprocess.Popen:
        self.started = time.monotonic()
        return subprocess.Popen(self.command.argv, env=self.command.env)

    @property
    def name(self) -> str:
        return self.command.argv[self.command.argv.index("--hostname") + 1]

    def check(self) -> int | None:
        """Restarts the process when it is due; returns its exit code once it has failed
        too often in a row to go on."""
        if self.restart_at is not None:
            if time.monotonic() >= self.restart_at:
                self.restart_at = None
                self.process = self._start()
            return None
        code = self.process.poll()
        if code is None:
            return None
        ran = time.monotonic() - self.started
        self.quick_failures = 0 if ran > RESTART_BACKOFF_CAP else self.quick_failures + 1
        if self.quick_failures >= MAX_QUICK_FAILURES:
            _say(f"{self.name}: exited {MAX_QUICK_FAILURES} times in a row soon after it "
                 f"started (last code {code}); giving up")  # fmt: skip
            return code or 1
        delay = min(RESTART_BACKOFF_CAP, 2.0**self.quick_failures)
        _say(f"{self.name}: exited with code {code}; starting it again in {delay:.0f} s")
        self.restart_at = time.monotonic() + delay
        return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def supervise(commands: list[WorkerCommand]) -> int:
    """Runs the workers until told to stop, starting again any that dies (with backoff);
    passes stop signals on.

    Celery's warm shutdown on SIGTERM lets a running batch finish; a second SIGTERM or a
    SIGQUIT stops at once, and acks_late hands the unfinished batch back to the queue.
    """
    workers = [Supervised(command) for command in commands]
    stopping: list[int] = []

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        for worker in workers:
            if worker.process.poll() is None:
                worker.process.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, forward)
    failed = 0
    while not stopping and not failed:
        failed = next((code for worker in workers if (code := worker.check())), 0)
        time.sleep(POLL_SECONDS)
    if failed:
        forward(signal.SIGTERM, None)
    codes = [worker.process.wait() for worker in workers]
    return failed or next((code for code in codes if code), 0)
