"""A data-parallel train-shard job's processes on one machine (one node). The worker starts
one process per local rank as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT for torch.distributed's env:// rendezvous), waits for them, and stops them all
as soon as one fails, so the job fails at once instead of hanging; it is sent again and
goes on from its last checkpoint. Each rank dies with the worker (parent-death signals): a
worker killed mid-job leaves no rank holding a GPU. No torch here.

The ranks are forked from the worker's rank fork server (server.py, forks.py), which
imports torch and the trainer once, before a run needs them (rank_server); each rank starts with
them loaded, in a fraction of a second. The ranks outlive the job (RankGroup): they take
the run's jobs one after another, each announced on a pipe from the worker, and keep the
process group, the model and the training state on the devices in between; the next job of
the run on this worker goes on from where the last one stopped. Over several machines, each
node's ranks are kept so, and go on together when the gang does (gang/). A rank shows as
`sdq-rank<local rank>` in ps and top, its server as `sdq-rank-server`."""

import json
import os
import shutil
import signal
import socket
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
from sdq.workers.train.ranks.folder import DONE_FILE, ERROR_FILE, LOG_FILE, RESULT_FILE, write_job
from sdq.workers.train.ranks.forks import WATCH_SECONDS, Rank, RankFailed, rank_server
from sdq.workers.weights import ModelUnavailable

NEXT_JOB = b"next\n"  # what the worker sends a rank for each job, once its spec is written
POLL_SECONDS = 0.02  # a job's end is seen this soon: the run's last one is on its clock
STOP_GRACE_SECONDS = 10
LOG_LINES = 20
# Errors a rank reports by name that keep their meaning for the job: a model that cannot
# be had and a diverged run are permanent, an object store that is down is an outage.
KNOWN_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error for error in (ModelUnavailable, Diverged, StoreUnavailable)
}


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


class RankGroup:
    """A run's rank processes on this machine (node `node` of its gang), kept from one of
    its jobs to the next."""

    def __init__(self, spec: TrainShardSpec, node: Node, watch: Callable[[], None]) -> None:
        """This node's ranks for the run, forked now, each with its place in the run's
        group; `watch` is called about once a second while they start."""
        self.run, self.world_size = spec.run, spec.options.world_size
        self.node = node
        self.stopped = False
        self.folder = Path(tempfile.mkdtemp(prefix="sdq-ranks-"))
        try:
            write_job(self.folder, spec, None)
            self.ranks = start(self.folder, spec.options, node, watch)
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    def serves(self, spec: TrainShardSpec) -> bool:
        """Whether it can take this job: same run, same world size, every rank alive."""
        alive = not self.stopped and all(rank.exitcode is None for rank in self.ranks)
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
            for rank in self.ranks:
                rank.jobs.write(NEXT_JOB)
            wait_for_job(self.ranks, self.folder, watch)
            result = self.folder / RESULT_FILE
            return json.loads(result.read_text()) if result.is_file() else None
        except BaseException:
            self.stop()
            raise

    @property
    def _ranks(self) -> range:
        return range(len(self.ranks))

    def stop(self) -> None:
        if not self.stopped:
            stop(self.ranks)
            shutil.rmtree(self.folder, ignore_errors=True)
            self.stopped = True


def start(folder: Path, options: TrainOptions, node: Node, watch: Callable[[], None]) -> list[Rank]:
    """This node's rank processes for a run, forked from the worker's rank fork server,
    each with the worker's environment and its place in the run's group."""
    local_ranks = options.ranks_per_node
    threads = torch_threads(local_ranks)
    server = rank_server()
    ranks: list[Rank] = []
    try:
        for local in range(local_ranks):
            environment = {
                **os.environ,
                **rendezvous(options, node, local),
                "LOCAL_RANK": str(local),
                # The machine's cores shared between its ranks, not each taking them all.
                "OMP_NUM_THREADS": str(threads),
            }
            log = folder / LOG_FILE.format(rank=local)
            ranks.append(server.fork(folder, log, environment, watch))
    except BaseException:
        stop(ranks)
        raise
    return ranks


def stop(ranks: list[Rank]) -> None:
    running = [rank for rank in ranks if rank.exitcode is None]
    for rank in running:
        rank.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for rank in running:
        if not rank.wait(max(0.0, deadline - time.monotonic())):
            rank.send_signal(signal.SIGKILL)
            rank.wait(None)
    for rank in ranks:
        rank.close()


def wait_for_job(ranks: list[Rank], folder: Path, watch: Callable[[], None] = lambda: None) -> None:
    """Until every rank of a group has said it did its part of the job; a rank that exits
    meanwhile, whatever its code, fails the job."""
    watched = time.monotonic()
    while True:
        codes = [rank.exitcode for rank in ranks]
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
    return not (folder / ERROR_FILE.format(rank=rank)).is_file()


def rank_error(folder: Path, rank: int, code: int) -> Exception:
    report = folder / ERROR_FILE.format(rank=rank)
    if report.is_file():
        error = json.loads(report.read_text())
        if (known := KNOWN_ERRORS.get(error["type"])) is not None:
            return known(f"rank {rank}: {error['message']}")  # the job's error names its kind
        return RankFailed(f"rank {rank}: {error['type']}: {error['message']}")
    log = (folder / LOG_FILE.format(rank=rank)).read_text(errors="replace").splitlines()
    tail = "\n".join(log[-LOG_LINES:])
    return RankFailed(f"rank {rank} exited with code {code}:\n{tail}")


def too_many_here(settings: TrainSettings, spec: TrainShardSpec) -> str | None:
    """Why this machine will not start the ranks a node of the job needs: more than its
    --train-ranks, or, without GPUs and without it, than the cores it may use."""
    from sdq.workers.gpu import cpu_cores  # here: torch loads with the work, not the module

    return settings.too_many_ranks(spec.run, spec.options.ranks_per_node, cpu_cores=cpu_cores())
