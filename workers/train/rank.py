"""One rank of a data-parallel train-shard job, a process of its own started by the worker
that took the job (workers/train/ranks.py): `python -m sdq.workers.train.rank FOLDER`,
the job's spec in FOLDER, torch.distributed's rendezvous in the environment. Rank 0 writes
the checkpoint and leaves what the worker records (the steps, the checkpoint) in FOLDER.

With `--serve` the rank takes job after job of one run: each line on its standard input
says the next job's spec is in FOLDER; it keeps its process group, model and training state
between them, and goes on in memory when the job starts where the last one stopped (it
restores the job's checkpoint otherwise). Each job ends with a done file in FOLDER; the end
of its input ends the process. GPU-side: imports torch.
"""

import ctypes
import json
import os
import signal
import sys
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from sdq.models.settings import Settings
from sdq.models.store import ObjectStore, open_store
from sdq.models.training import TrainShardSpec
from sdq.workers.train.job import restore_state, train_steps, write_checkpoint
from sdq.workers.train.ranks import DONE_FILE, JOB_FILE, RESULT_FILE, STOP_FILE
from sdq.workers.train.trainer import Ranks, TrainState
from sdq.workers.weights import ModelFiles

PR_SET_PDEATHSIG = 1


class NotEnoughDevices(Exception):
    pass


def die_with_parent() -> None:
    """The kernel kills this process when the worker that started it dies, whatever
    killed the worker (a SIGKILL, the task's hard time limit)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ["SDQ_RANK_PARENT"]):
        os._exit(1)  # the parent died before the signal was armed


def ranks_from_env() -> Ranks:
    return Ranks(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )


@dataclass(frozen=True)
class RankDone:
    # What rank 0 leaves for the worker: the steps and the checkpoint written.
    result: dict[str, Any] | None
    # Held until the process exits, never freed: see exit_now.
    state: TrainState


def train_rank(spec: TrainShardSpec, ranks: Ranks, settings: Settings, folder: Path) -> RankDone:
    """This rank's part of the job."""
    join_group(spec, ranks, settings)
    try:
        store = open_store(settings.store_url)
        files = ModelFiles(store, settings.model_cache_dir)
        state = restore_state(spec, store, files, ranks)
        return RankDone(train_job(spec, state, store, files, settings, _stop_at(folder)), state)
    finally:
        dist.destroy_process_group()


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
        timeout=timedelta(seconds=settings.train.collective_timeout_seconds),
    )


def train_job(
    spec: TrainShardSpec,
    state: TrainState,
    store: ObjectStore,
    files: ModelFiles,
    settings: Settings,
    stop_at: float | None,
) -> dict[str, Any] | None:
    """The job's steps from `state`; on rank 0, the checkpoint and what the worker records."""
    steps = train_steps(spec, state, store, settings.train, stop_at)
    if not state.ranks.writes:
        return None
    written = write_checkpoint(spec, state, store, files)
    return {"steps": steps, "written": asdict(written)}


def serve(folder: Path, ranks: Ranks, settings: Settings) -> NoReturn:
    """Job after job of one run, each announced by a line on standard input."""
    spec = _job(folder)
    join_group(spec, ranks, settings)
    store = open_store(settings.store_url)
    files = ModelFiles(store, settings.model_cache_dir)
    state: TrainState | None = None
    while sys.stdin.readline():
        spec = _job(folder)
        if state is None or state.step != spec.first_step:
            state = None  # its memory goes before the restored state takes its own
            state = restore_state(spec, store, files, ranks)
        result = train_job(spec, state, store, files, settings, _stop_at(folder))
        if result is not None:
            (folder / RESULT_FILE).write_text(json.dumps(result))
        (folder / DONE_FILE.format(rank=ranks.rank)).touch()
    exit_now(0)  # the worker let the group go


def _job(folder: Path) -> TrainShardSpec:
    return TrainShardSpec.from_dict(json.loads((folder / JOB_FILE).read_text()))


def _stop_at(folder: Path) -> float | None:
    """When the job should stop taking steps (rank 0's decision: see ranks.py)."""
    stop = folder / STOP_FILE
    return float(stop.read_text()) if stop.is_file() else None


def exit_now(code: int) -> NoReturn:
    """Ends the process without freeing anything: freeing DDP's reducer joins gloo's worker
    thread while holding the GIL, which that thread may need to free its last work, a
    deadlock seen here at exit. A rank has nothing left to clean up; the OS takes it all."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(folder: Path, serving: bool) -> NoReturn:
    die_with_parent()
    ranks = ranks_from_env()
    try:
        if serving:
            serve(folder, ranks, Settings.from_env())
        done = train_rank(_job(folder), ranks, Settings.from_env(), folder)
    except Exception as error:
        traceback.print_exc()
        report = {"type": type(error).__name__, "message": str(error)}
        (folder / f"error-{ranks.rank}.json").write_text(json.dumps(report))
        exit_now(1)  # inside the handler: the traceback still holds the state
    if done.result is not None:
        (folder / RESULT_FILE).write_text(json.dumps(done.result))
    exit_now(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]), serving="--serve" in sys.argv[2:])
