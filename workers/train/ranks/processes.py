"""A data-parallel train-shard job's processes on one machine (one node). The worker starts
one process per local rank as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT for torch.distributed's env:// rendezvous), waits for them, and stops them all
as soon as one fails, so the job fails at once instead of hanging; it is sent again and
goes on from its last checkpoint. Each rank dies with the worker (a parent-death signal): a
worker killed mid-job leaves no rank holding a GPU. No torch here.

Ranks are started before a job needs them (Spares: torch and the trainer imported
meanwhile) and join its process group when it comes, as lines on their standard input.
They outlive the job (RankGroup): they take the run's jobs one after another and keep the
process group, the model and the training state on the devices in between; the next job
of the run on this worker goes on from where the last one stopped. Over several machines,
each node's ranks are kept so, and go on together when the gang does (gang/)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sdq.models.cores import torch_threads
from sdq.models.store import StoreUnavailable
from sdq.models.train.routing import node_key, run_key
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import TrainOptions, TrainShardSpec
from sdq.workers.train.loop.diverged import Diverged
from sdq.workers.weights import ModelUnavailable

RANK_MODULE = "sdq.workers.train.ranks"
JOB_FILE = "job.json"
RESULT_FILE = "result.json"
# A rank writes this (by its local rank) when it has done its part of a job.
DONE_FILE = "done-{rank}"
# When the job should stop taking steps and write its checkpoint (a time.time()), if ever.
STOP_FILE = "stop-at"
POLL_SECONDS = 0.02  # a job's end is seen this soon: the run's last one is on its clock
WATCH_SECONDS = 1.0
STOP_GRACE_SECONDS = 10
LOG_LINES = 20
# Errors a rank reports by name that keep their meaning for the job: a model that cannot
# be had and a diverged run are permanent, an object store that is down is an outage.
KNOWN_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error for error in (ModelUnavailable, Diverged, StoreUnavailable)
}


class RankFailed(Exception):
    """A rank of the job's group died or failed: the job fails, and goes on from its last
    checkpoint when it is sent again."""


@dataclass(frozen=True)
class Node:
    """This machine's place in the job's gang, and where rank 0's store listens."""

    index: int = 0
    master_address: str = "127.0.0.1"
    master_port: int = field(default_factory=lambda: free_port())

    @property
    def rendezvous(self) -> str:
        """host:port of rank 0's store, as a gathering records it (gang/gathering.py)."""
        return f"{self.master_address}:{self.master_port}"


def write_job(folder: Path, spec: TrainShardSpec, stop_at: float | None) -> None:
    (folder / JOB_FILE).write_text(json.dumps(spec.to_dict()))
    stop = folder / STOP_FILE
    stop.unlink(missing_ok=True)
    if stop_at is not None:
        stop.write_text(repr(stop_at))


def rendezvous(options: TrainOptions, node: Node, local: int) -> dict[str, str]:
    """What torch.distributed's env:// rendezvous reads, for one local rank of a job."""
    return {
        "RANK": str(node.index * options.ranks_per_node + local),
        "WORLD_SIZE": str(options.world_size),
        "MASTER_ADDR": node.master_address,
        "MASTER_PORT": str(node.master_port),
    }


def free_port(address: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


class Spares:
    """A node's rank processes started before a run needs them: each imports torch and the
    trainer, then waits on its standard input for the rendezvous of the run it is to join.
    A run's first job starts on them without waiting for those imports (seconds a process;
    most of the 8 s two ranks took to start on two busy cores)."""

    def __init__(self, local_ranks: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="sdq-ranks-"))
        self.processes = start(local_ranks, self.folder)

    def fit(self, local_ranks: int) -> bool:
        """Whether they can serve a run of that many ranks here: enough, and all alive."""
        alive = all(process.poll() is None for process in self.processes)
        return alive and len(self.processes) >= local_ranks

    def stop(self) -> None:
        stop(self.processes)
        shutil.rmtree(self.folder, ignore_errors=True)


class RankGroup:
    """A run's rank processes on this machine (node `node` of its gang), kept from one of
    its jobs to the next."""

    def __init__(self, spec: TrainShardSpec, spares: Spares | None, node: Node) -> None:
        """This node's ranks for the run: the spares, when they fit it (the ones past its
        ranks stopped), else processes started now."""
        self.run, self.world_size = spec.run, spec.options.world_size
        self.node = node
        local_ranks = spec.options.ranks_per_node
        if spares is None or not spares.fit(local_ranks):
            if spares is not None:
                spares.stop()
            spares = Spares(local_ranks)
        stop(spares.processes[local_ranks:])
        self.folder, self.processes = spares.folder, spares.processes[:local_ranks]
        try:
            write_job(self.folder, spec, None)
            for local, process in enumerate(self.processes):
                joining = {**rendezvous(spec.options, self.node, local),
                           "threads": torch_threads(local_ranks)}  # fmt: skip
                process.stdin.write(json.dumps(joining).encode() + b"\n")
                process.stdin.flush()
        except BaseException:
            self.stop()
            raise

    def serves(self, spec: TrainShardSpec) -> bool:
        """Whether it can take this job: same run, same world size, every rank alive."""
        alive = all(process.poll() is None for process in self.processes)
        return alive and (spec.run, spec.options.world_size) == (self.run, self.world_size)

    @property
    def warm_key(self) -> str:
        """Where the run's jobs (node 0), or its leader's calls to go on (a member node),
        find this group (models/train/routing.py)."""
        index = self.node.index
        return node_key(self.run, index) if index else run_key(self.run)

    def train(
        self,
        spec: TrainShardSpec,
        stop_at: float | None = None,
        watch: Callable[[], None] = lambda: None,
    ) -> dict | None:
        """Has the ranks take one job; returns what rank 0 wrote (on node 0). `watch` is
        called about once a second meanwhile, and stops them by raising. Any failure (a
        rank's error or death, the task's time limit, the watch) stops the group: its state
        is not the checkpoint's any more."""
        try:
            for leftover in [RESULT_FILE, *(DONE_FILE.format(rank=r) for r in self._ranks)]:
                (self.folder / leftover).unlink(missing_ok=True)
            write_job(self.folder, spec, stop_at)
            for process in self.processes:
                process.stdin.write(b"next\n")
                process.stdin.flush()
            wait_for_job(self.processes, self.folder, watch)
            result = self.folder / RESULT_FILE
            return json.loads(result.read_text()) if result.is_file() else None
        except BaseException:
            self.stop()
            raise

    @property
    def _ranks(self) -> range:
        return range(len(self.processes))

    def stop(self) -> None:
        stop(self.processes)
        shutil.rmtree(self.folder, ignore_errors=True)


def start(local_ranks: int, folder: Path) -> list[subprocess.Popen]:
    """This node's rank processes (Spares), which read their rendezvous, then the jobs,
    from their standard input."""
    processes: list[subprocess.Popen] = []
    try:
        for local in range(local_ranks):
            environment = {
                **os.environ,
                "LOCAL_RANK": str(local),
                "SDQ_RANK_PARENT": str(os.getpid()),
                # The machine's cores shared between its ranks, not each taking them all.
                "OMP_NUM_THREADS": str(torch_threads(local_ranks)),
            }
            command = [sys.executable, "-m", RANK_MODULE, str(folder)]
            with (folder / f"rank{local}.log").open("wb") as log:
                processes.append(
                    subprocess.Popen(
                        command,
                        env=environment,
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
    except BaseException:
        stop(processes)
        raise
    return processes


def stop(processes: list[subprocess.Popen]) -> None:
    running = [process for process in processes if process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_for_job(
    processes: list[subprocess.Popen], folder: Path, watch: Callable[[], None] = lambda: None
) -> None:
    """Until every rank of a group has said it did its part of the job; a rank that exits
    meanwhile, whatever its code, fails the job."""
    watched = time.monotonic()
    while True:
        codes = [process.poll() for process in processes]
        ended = [(rank, code) for rank, code in enumerate(codes) if code is not None]
        if ended:
            raise rank_error(folder, *min(ended, key=lambda item: _reported(folder, item[0])))
        if all((folder / DONE_FILE.format(rank=rank)).is_file() for rank in range(len(codes))):
            return
        if time.monotonic() - watched >= WATCH_SECONDS:
            watch()
            watched = time.monotonic()
        time.sleep(POLL_SECONDS)


def _reported(folder: Path, rank: int) -> bool:
    """False sorts first: a rank that said why it failed is the one to report."""
    return not (folder / f"error-{rank}.json").is_file()


def rank_error(folder: Path, rank: int, code: int) -> Exception:
    report = folder / f"error-{rank}.json"
    if report.is_file():
        error = json.loads(report.read_text())
        if (known := KNOWN_ERRORS.get(error["type"])) is not None:
            return known(f"rank {rank}: {error['message']}")  # the job's error names its kind
        return RankFailed(f"rank {rank}: {error['type']}: {error['message']}")
    log = (folder / f"rank{rank}.log").read_text(errors="replace").splitlines()
    tail = "\n".join(log[-LOG_LINES:])
    return RankFailed(f"rank {rank} exited with code {code}:\n{tail}")


def too_many_here(settings: TrainSettings, spec: TrainShardSpec) -> str | None:
    """Why this machine will not start the ranks a node of the job needs: more than its
    --train-ranks, or, without GPUs and without it, than the cores it may use."""
    from sdq.workers.gpu import cpu_cores  # here: torch loads with the work, not the module

    return settings.too_many_ranks(spec.run, spec.options.ranks_per_node, cpu_cores=cpu_cores())
