"""The job's folder, where a node's worker and its rank processes meet: the worker writes
each job's spec (and when to stop taking steps) there, the ranks their logs, errors and
done marks, and rank 0 what the worker records. No torch here."""

import json
from pathlib import Path

from sdq.models.train.specs import TrainShardSpec

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
# A rank writes this (by its local rank) when it has done its part of a job.
DONE_FILE = "done-{rank}"
LOG_FILE = "rank{rank}.log"
# A rank's error, by its local rank: its type's name and message.
ERROR_FILE = "error-{rank}.json"
# When the job should stop taking steps and write its checkpoint (a time.time()), if ever.
STOP_FILE = "stop-at"


def write_job(folder: Path, spec: TrainShardSpec, stop_at: float | None) -> None:
    (folder / JOB_FILE).write_text(json.dumps(spec.to_dict()))
    stop = folder / STOP_FILE
    stop.unlink(missing_ok=True)
    if stop_at is not None:
        stop.write_text(repr(stop_at))


def read_job(folder: Path) -> TrainShardSpec:
    return TrainShardSpec.from_dict(json.loads((folder / JOB_FILE).read_text()))


def read_stop_at(folder: Path) -> float | None:
    """When the job should stop taking steps (rank 0's decision: see processes.py)."""
    stop = folder / STOP_FILE
    return float(stop.read_text()) if stop.is_file() else None
