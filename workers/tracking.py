"""A run's figures for the trackers people watch training in (`--report-to tensorboard`):
TensorBoard event files in the store under runs/<run>/tensorboard/, one per train-shard job
(its steps) and one per evaluation (its scores), each named by what it holds, so that an
attempt done again rewrites its file instead of adding a twin. TensorBoard reads the
folder (synced from S3, or a local store's) as one run. A tracker that fails never fails
the work: every figure is in SQL anyway."""

import logging
import tempfile
from collections.abc import Iterable
from pathlib import Path

from sdq.models.store import ObjectStore

logger = logging.getLogger(__name__)

# (tag, step, value): "train/loss", 120, 0.093.
Scalar = tuple[str, int, float]


def tensorboard_key(run_id: int, name: str) -> str:
    return f"runs/{run_id}/tensorboard/events.out.tfevents.{name}"


def report(
    store: ObjectStore, run_id: int, name: str, scalars: Iterable[Scalar], trackers: Iterable[str]
) -> None:
    """The scalars, to each tracker the run reports to."""
    if "tensorboard" not in trackers:
        return
    try:
        data = _event_file(scalars)
        store.put_bytes(tensorboard_key(run_id, name), data,
                        content_type="application/octet-stream")  # fmt: skip
    except Exception:
        logger.exception("run %s: %s not written for TensorBoard", run_id, name)


def _event_file(scalars: Iterable[Scalar]) -> bytes:
    from torch.utils.tensorboard import SummaryWriter  # only where a run reports to it

    with tempfile.TemporaryDirectory(prefix="sdq-tensorboard-") as folder:
        writer = SummaryWriter(log_dir=folder)
        for tag, step, value in scalars:
            writer.add_scalar(tag, value, step)
        writer.close()
        [written] = Path(folder).glob("events.out.tfevents.*")
        return written.read_bytes()
