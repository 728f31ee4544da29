"""One rank of a data-parallel train-shard job, a process of its own that the worker forks
from its rank fork server (processes.py, server.py) when the run comes. It takes job after
job of the run, each announced on its pipe from the worker once the job's spec is in
FOLDER; it keeps its process group, model and training state between them, and goes on in
memory when the job starts where the last one stopped (it restores the job's checkpoint
otherwise, once per node: the first local rank downloads it into FOLDER). Rank 0 writes
each job's checkpoint on a thread and leaves what the worker records (the steps, the
checkpoint) in FOLDER; meanwhile the ranks take the next job's steps. Each job ends with a
done file in FOLDER (rank 0's once its checkpoint is written); the pipe's end (the worker
let the ranks go, or died) ends the process.
GPU-side: imports torch.
"""

import json
import os
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO, NoReturn

import torch
import torch.distributed as dist

from sdq.models.db import make_engine, session_factory
from sdq.models.settings import Settings
from sdq.models.store import ObjectStore, open_store
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.train.loop.build import restore_state
from sdq.workers.train.loop.checkpoints import Snapshot, write_checkpoint
from sdq.workers.train.loop.sharding import ShardedSnapshot
from sdq.workers.train.loop.state import Ranks, TrainState
from sdq.workers.train.loop.training import Stop, Training, rank0_decides, until_time
from sdq.workers.train.ranks.folder import (
    DONE_FILE,
    ERROR_FILE,
    RESULT_FILE,
    read_job,
    read_stop_at,
)
from sdq.workers.train.records import LiveSteps
from sdq.workers.weights import ModelFiles


class NotEnoughDevices(Exception):
    pass


def ranks_from_env() -> Ranks:
    return Ranks(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )


def join_group(spec: TrainShardSpec, ranks: Ranks, settings: Settings) -> None:
    """This process's device, and the job's process group."""
    if torch.cuda.is_available():
        if ranks.local_rank >= torch.cuda.device_count():
            raise NotEnoughDevices(
                f"train run {spec.run} trains on {ranks.world_size} ranks, one GPU each; this "
                f"worker sees {torch.cuda.device_count()}: `sdq worker gpu --train-ranks "
                f"{ranks.world_size}` gives its train worker that many"
            )
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        timeout=timedelta(seconds=settings.group(TrainSettings).collective_timeout_seconds),
    )


def serve(folder: Path, announced: BinaryIO, ranks: Ranks, settings: Settings) -> NoReturn:
    """Job after job of one run, each announced on `announced`. Between two,
    the next job's steps are taken while rank 0 writes the last one's checkpoint on a
    thread, until the next job is announced (on rank 0's node: over several nodes, rank 0
    decides for every rank): it then takes them over."""
    spec = read_job(folder)
    join_group(spec, ranks, settings)
    store = open_store(settings.store_url)
    files = ModelFiles(store, settings.model_cache_dir)
    jobs = announcements(announced)
    training: Training | None = None
    while jobs.get():
        spec = read_job(folder)
        if training is None or not training.goes_on_to(spec):
            if training is not None:
                training.close()
            training = None  # its memory goes before the restored state takes its own
            state = restore_state(spec, store, files, ranks, node_folder=folder)
            training = Training(
                spec, state, store, settings.group(TrainSettings), live_steps(ranks, settings)
            )
        steps = training.steps(spec, until_time(read_stop_at(folder), training.state))
        done = folder / DONE_FILE.format(rank=ranks.local_rank)
        snapshot = training.checkpoint(spec)
        if snapshot is None:
            done.touch()
        else:
            write_in_background(spec, snapshot, steps, store, files, ranks, folder)
        following = spec.next_after(training.state.step)
        if following is not None:
            training.train_ahead(following, until_announced(jobs, training.state))
    exit_now(0)  # the worker let the group go


def live_steps(ranks: Ranks, settings: Settings) -> Callable[[list[dict]], None]:
    """Rank 0 writes the steps to the database as they are taken (records.LiveSteps)."""
    if not ranks.writes:
        return lambda steps: None
    return LiveSteps(
        session_factory(make_engine(settings.database_url)),
        settings.group(TrainSettings).live_steps_seconds,
    )


def announcements(announced: BinaryIO) -> "queue.Queue[bool]":
    """True for each job announced (a line), then False at the pipe's end: read on a
    thread, so that steps taken ahead can ask whether the next job has come."""
    jobs: queue.Queue[bool] = queue.Queue()

    def read() -> None:
        while announced.readline():
            jobs.put(True)
        jobs.put(False)

    threading.Thread(target=read, name="sdq-announcements", daemon=True).start()
    return jobs


def until_announced(jobs: "queue.Queue[bool]", state: TrainState) -> Stop:
    """Stops once the next job has come (or the worker let the group go): rank 0's view."""
    return lambda: rank0_decides(not jobs.empty(), state)


def write_in_background(
    spec: TrainShardSpec,
    snapshot: Snapshot | ShardedSnapshot,
    steps: list[dict],
    store: ObjectStore,
    files: ModelFiles,
    ranks: Ranks,
    folder: Path,
) -> None:
    """The checkpoint (this rank's part of it, when sharded) written on a thread, then what
    the worker records; a failure to write it fails the rank (and so the job), as it would
    have in the job's own time."""

    def write() -> None:
        try:
            written = write_checkpoint(spec, snapshot, store, files)
        except Exception as error:
            fail(folder, ranks.local_rank, error)
        if written is not None:
            result = {"steps": steps, "written": asdict(written)}
            (folder / RESULT_FILE).write_text(json.dumps(result))
        (folder / DONE_FILE.format(rank=ranks.local_rank)).touch()

    threading.Thread(target=write, name="sdq-checkpoint-write", daemon=True).start()


def fail(folder: Path, rank: int, error: Exception) -> NoReturn:
    """Ends the rank with its error reported for the worker (processes.py reads it)."""
    traceback.print_exc()
    report = {"type": type(error).__name__, "message": str(error)}
    (folder / ERROR_FILE.format(rank=rank)).write_text(json.dumps(report))
    exit_now(1)


def exit_now(code: int) -> NoReturn:
    """Ends the process without freeing anything: freeing DDP's reducer joins gloo's worker
    thread while holding the GIL, which that thread may need to free its last work, a
    deadlock seen here at exit. A rank has nothing left to clean up; the OS takes it all."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(folder: Path, announced: BinaryIO) -> NoReturn:
    """The rank's work, in the process forked for it with its place in the run's group in
    its environment (server.run_rank)."""
    # Its share of the cores: the fork server's torch read OMP_NUM_THREADS as it loaded,
    # from the worker's environment, not this rank's.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    ranks = ranks_from_env()
    try:
        serve(folder, announced, ranks, Settings.from_env())
    except Exception as error:
        fail(folder, ranks.local_rank, error)  # inside the handler: the traceback holds the state
