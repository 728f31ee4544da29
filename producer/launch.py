"""Starting worker processes: plain `celery worker` commands, one per GPU.

The parent never imports torch or touches CUDA; each child sees one GPU through
CUDA_VISIBLE_DEVICES and loads its pipeline on first use.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import IO

from sdq.models.jobs.kinds import KINDS, POOL_QUEUES, Pool
from sdq.workers.app import NAME_TAKEN

CELERY_APP = "sdq.workers.main"
# A dead worker is started again after 2, 4, 8... seconds, at most RESTART_BACKOFF_CAP; one
# that ran longer than that before dying starts the count afresh. The launcher never
# gives up: a worker that cannot start (its broker down for an hour) comes back on its own
# once it can, and each death is said with its cause.
FIRST_RESTART_DELAY = 2.0
RESTART_BACKOFF_CAP = 60.0
POLL_SECONDS = 0.5
# Lines of a worker's output kept to say why it died.
LAST_WORDS = 50
# glibc's malloc reads these at start (mallopt's M_MMAP_THRESHOLD, M_TRIM_THRESHOLD); other
# C libraries ignore them.
MALLOC_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
MALLOC_TRIM_THRESHOLD = "MALLOC_TRIM_THRESHOLD_"
# A model's work on the CPU (all of it without a GPU; decoding and preprocessing beside
# one) allocates and frees buffers of megabytes at every layer of every batch. glibc's
# defaults map the larger ones afresh each time and give freed memory back, so the next
# batch zero-fills them again page by page (30,000-50,000 page faults per forward of the
# curate benchmark's CLIP, a quarter of its time). Kept in the heap up to glibc's largest
# threshold (32 MiB), with up to 1 GiB of freed memory held at its top, they are reused.
REUSED_HOST_BUFFERS = {MALLOC_MMAP_THRESHOLD: str(32 << 20), MALLOC_TRIM_THRESHOLD: str(1 << 30)}


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


def torch_gpu_view(gpus: list[str]) -> tuple[int, str]:
    """How many of these GPUs torch sees, and its version and CUDA build: asked in a child
    process, so that this one never loads torch or touches CUDA."""
    probe = "import torch; print(torch.cuda.device_count(), torch.__version__, torch.version.cuda)"
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return 0, f"torch does not load: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    count, version, cuda = done.stdout.split()
    return int(count), f"torch {version} (CUDA build: {cuda})"


def celery_worker(
    queues: tuple[str, ...], *, name: str, concurrency: int, prefetch: int, loglevel: str
) -> list[str]:
    """Without mingle: at start it asks every live worker for its revoked tasks and waits a
    second for their answers, and sdq revokes none (a job is stopped through its record)."""
    return [
        sys.executable, "-m", "celery", "-A", CELERY_APP, "worker",
        "--queues", ",".join(queues),
        "--hostname", f"{name}@%h",
        "--concurrency", str(concurrency),
        "--prefetch-multiplier", str(prefetch),
        "--without-mingle",
        "--loglevel", loglevel,
    ]  # fmt: skip


# The kind whose jobs run on rank processes over GPUs of their own (one at most: its row
# says `on_ranks`), its queue and its worker's name.
RANKED = next((kind for kind in KINDS.values() if kind.on_ranks), None)
RANKED_QUEUES = (RANKED.queue,) if RANKED else ()
RANKED_WORKER = RANKED.name if RANKED else ""


def gpu_workers(
    gpus: list[str],
    *,
    loglevel: str,
    queues: tuple[str, ...] = POOL_QUEUES[Pool.gpu],
    ranks: int = 0,
) -> list[WorkerCommand]:
    """One prefork worker of concurrency 1 per GPU: the pipeline loads in the forked child,
    and a child killed mid-task gives its message back to the queue.

    With `ranks` R, the first R GPUs are one worker of the ranked kind instead, whose jobs
    run on up to R rank processes (one per GPU); the other GPUs serve the other queues. A
    GPU that trains never also holds a generation or encode pipeline."""
    commands = []
    if ranks:
        group, gpus = gpus[:ranks], gpus[ranks:]
        commands.append(_ranked_worker(group, ranks, loglevel))
        queues = tuple(queue for queue in queues if queue not in RANKED_QUEUES)
        if not queues or (group and not gpus):
            return commands
    if not gpus:
        argv = celery_worker(
            queues, name="cpu-render", concurrency=1, prefetch=1, loglevel=loglevel
        )
        environment = {**REUSED_HOST_BUFFERS, **os.environ, "CUDA_VISIBLE_DEVICES": ""}
        return [*commands, WorkerCommand(argv, environment)]
    return commands + [
        WorkerCommand(
            celery_worker(queues, name=f"gpu{gpu}", concurrency=1, prefetch=1, loglevel=loglevel),
            {**REUSED_HOST_BUFFERS, **os.environ, "CUDA_VISIBLE_DEVICES": gpu},
        )
        for gpu in gpus
    ]


def _ranked_worker(group: list[str], ranks: int, loglevel: str) -> WorkerCommand:
    """The ranked kind's worker over the GPUs of `group` (none: CPU ranks), told how many
    ranks a job may start here (its settings' SDQ_<KIND>_RANKS)."""
    argv = celery_worker(
        RANKED_QUEUES, name=RANKED_WORKER, concurrency=1, prefetch=1, loglevel=loglevel
    )
    environment = {
        **REUSED_HOST_BUFFERS,
        **os.environ,
        "CUDA_VISIBLE_DEVICES": ",".join(group),
        f"SDQ_{RANKED_WORKER.upper()}_RANKS": str(ranks),
    }
    return WorkerCommand(argv, environment)


def cpu_workers(concurrency: int, *, loglevel: str) -> list[WorkerCommand]:
    """One prefork worker; its processes download with many threads each. Their decoded
    images (up to SDQ_DOWNLOAD_PIXEL_BUDGET at once) are large buffers: glibc's malloc
    keeps freed ones in each thread's arena once its adaptive mmap threshold has risen,
    so a process's memory would grow to its peak once per thread. A fixed threshold
    (which turns the adaptation off) maps every buffer over 1 MiB on its own and gives it
    back to the system when it is freed."""
    argv = celery_worker(
        POOL_QUEUES[Pool.cpu], name="cpu", concurrency=concurrency, prefetch=4, loglevel=loglevel
    )
    return [WorkerCommand(argv, {MALLOC_MMAP_THRESHOLD: str(1 << 20), **os.environ})]


class Supervised:
    """One worker process, started again with backoff when it dies on its own: one GPU's
    crash leaves the others working. Its output passes through the launcher, which keeps
    the last lines to say why it died."""

    def __init__(
        self,
        command: WorkerCommand,
        *,
        first_delay: float = FIRST_RESTART_DELAY,
        cap: float = RESTART_BACKOFF_CAP,
        healthy_after: float = RESTART_BACKOFF_CAP,
    ) -> None:
        self.command = command
        self.first_delay, self.cap, self.healthy_after = first_delay, cap, healthy_after
        self.quick_failures = 0
        self.restart_at: float | None = None
        self.refused = False
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        self.started = time.monotonic()
        process = subprocess.Popen(
            self.command.argv, env=self.command.env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.last_lines: deque[str] = deque(maxlen=LAST_WORDS)
        self.relay = threading.Thread(target=self._pass_on, args=(process.stdout,), daemon=True)
        self.relay.start()
        return process

    def _pass_on(self, output: IO[bytes]) -> None:
        for line in output:
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            self.last_lines.append(line.decode(errors="replace").rstrip())

    @property
    def name(self) -> str:
        return self.command.argv[self.command.argv.index("--hostname") + 1]

    def check(self) -> None:
        """Starts the process again when it is due; when it has just died, says why and
        when it comes back."""
        if self.restart_at is not None:
            if time.monotonic() >= self.restart_at:
                self.restart_at = None
                self.process = self._start()
            return
        code = self.process.poll()
        if code is None or self.refused:
            return
        if code == NAME_TAKEN:
            _say(f"{self.name}: refused to start, its name is taken; not started again")
            self.refused = True
            return
        ran = time.monotonic() - self.started
        self.quick_failures = 1 if ran > self.healthy_after else self.quick_failures + 1
        delay = min(self.cap, self.first_delay * 2 ** (self.quick_failures - 1))
        _say(f"{self.name}: {self.death(code)}; starting it again in {delay:g} s")
        self.restart_at = time.monotonic() + delay

    def death(self, code: int) -> str:
        """How the process ended, in words: a signal by name (SIGKILL is what the kernel's
        out-of-memory killer sends), else its exit code and the last line it printed that
        names an error (Celery's "Unrecoverable error", an exception's last line)."""
        if code < 0:
            name = signal.Signals(-code).name
            return f"killed by {name}" + (", perhaps out of memory" if name == "SIGKILL" else "")
        self.relay.join(timeout=1)  # its last words may be in the pipe still
        errors = [line.strip() for line in self.last_lines if ERROR_WORDS.search(line)]
        return f"exited with code {code}" + (f" ({errors[-1]})" if errors else "")


ERROR_WORDS = re.compile(r"Error|Exception|CRITICAL|Unrecoverable")


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
    while not stopping and not all(worker.refused for worker in workers):
        for worker in workers:
            worker.check()
        time.sleep(POLL_SECONDS)
    codes = [worker.process.wait() for worker in workers]
    for worker in workers:
        worker.relay.join(timeout=2)  # what they said as they stopped
    return next((code for code in codes if code), 0)
