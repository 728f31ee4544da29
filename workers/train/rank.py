"""One rank of a data-parallel train-shard job, a process of its own started by the worker
that took the job (workers/train/ranks.py): `python -m sdq.workers.train.rank FOLDER`,
the job's spec in FOLDER, torch.distributed's rendezvous in the environment. Rank 0 writes
the checkpoint and leaves what the worker records (the steps, the checkpoint) in FOLDER.
GPU-side: imports torch.
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
from sdq.models.store import open_store
from sdq.models.training import TrainShardSpec
from sdq.workers.train.job import restore_state, train_steps, write_checkpoint
from sdq.workers.train.ranks import JOB_FILE, RESULT_FILE
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


def train_rank(spec: TrainShardSpec, ranks: Ranks, settings: Settings) -> RankDone:
    """This rank's part of the job."""
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
    try:
        store = open_store(settings.store_url)
        files = ModelFiles(store, settings.model_cache_dir)
        state = restore_state(spec, store, files, ranks)
        steps = train_steps(spec, state, store, settings.train)
        if not ranks.writes:
            return RankDone(None, state)
        written = write_checkpoint(spec, state, store, files)
        return RankDone({"steps": steps, "written": asdict(written)}, state)
    finally:
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Ends the process without freeing anything: freeing DDP's reducer joins gloo's worker
    thread while holding the GIL, which that thread may need to free its last work, a
    deadlock seen here at exit. A rank has nothing left to clean up; the OS takes it all."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(folder: Path) -> NoReturn:
    die_with_parent()
    ranks = ranks_from_env()
    spec = TrainShardSpec.from_dict(json.loads((folder / JOB_FILE).read_text()))
    try:
        done = train_rank(spec, ranks, Settings.from_env())
    except Exception as error:
        traceback.print_exc()
        report = {"type": type(error).__name__, "message": str(error)}
        (folder / f"error-{ranks.rank}.json").write_text(json.dumps(report))
        exit_now(1)  # inside the handler: the traceback still holds the state
    if done.result is not None:
        (folder / RESULT_FILE).write_text(json.dumps(done.result))
    exit_now(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
