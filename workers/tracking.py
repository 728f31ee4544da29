"""A run's figures for the trackers people watch training in (`--report-to`). A tracker
that fails never fails the work: every figure is in SQL anyway.

- tensorboard: event files in the store under runs/<run>/tensorboard/, one per train-shard
  job (its steps) and one per evaluation (its scores), each named by what it holds, so that
  an attempt done again rewrites its file instead of adding a twin. TensorBoard reads the
  folder (synced from S3, or a local store's) as one run.
- wandb: the W&B run `sdq-run-<run>`, which every job of the run resumes, in the project
  WANDB_PROJECT names (else "sdq"); W&B's own variables (WANDB_API_KEY, WANDB_MODE,
  WANDB_DIR, WANDB_ENTITY) decide the rest."""

import logging
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from sdq.models.store import ObjectStore

logger = logging.getLogger(__name__)

# (tag, step, value): "train/loss", 120, 0.093. A tag's section ("train") is its chart group.
Scalar = tuple[str, int, float]


def tensorboard_key(run_id: int, name: str) -> str:
    return f"runs/{run_id}/tensorboard/events.out.tfevents.{name}"


def report(
    store: ObjectStore, run_id: int, name: str, scalars: Sequence[Scalar], trackers: Sequence[str]
) -> None:
    """The scalars, to each tracker the run reports to; `name` says what they are (a job's
    steps, a checkpoint's scores)."""
    for tracker in trackers:
        try:
            WRITERS[tracker](store, run_id, name, scalars)
        except Exception:
            logger.exception("run %s: %s not sent to %s", run_id, name, tracker)


def _to_tensorboard(store: ObjectStore, run_id: int, name: str, scalars: Sequence[Scalar]) -> None:
    from torch.utils.tensorboard import SummaryWriter  # only where a run reports to it

    with tempfile.TemporaryDirectory(prefix="sdq-tensorboard-") as folder:
        writer = SummaryWriter(log_dir=folder)
        for tag, step, value in scalars:
            writer.add_scalar(tag, value, step)
        writer.close()
        [written] = Path(folder).glob("events.out.tfevents.*")
        store.put_bytes(tensorboard_key(run_id, name), written.read_bytes(),
                        content_type="application/octet-stream")  # fmt: skip


def _to_wandb(_store: ObjectStore, run_id: int, _name: str, scalars: Sequence[Scalar]) -> None:
    import wandb  # only where a run reports to it

    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT", "sdq"),
        id=f"sdq-run-{run_id}",
        name=f"sdq run {run_id}",
        resume="allow",
        # Not the worker's own output: W&B would capture every job's log lines.
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        # Steps come out of order (a checkpoint's scores after later steps were trained)
        # and again (a retried job): each section's step is a figure of its own, its
        # charts' x-axis, and W&B's own step only the order they arrived in.
        by_step: dict[tuple[str, int], dict[str, float]] = defaultdict(dict)
        for tag, step, value in scalars:
            by_step[tag.partition("/")[0], step][tag] = value
        for section in {section for section, _ in by_step}:
            run.define_metric(f"{section}/step", hidden=True)
            run.define_metric(f"{section}/*", step_metric=f"{section}/step")
        for (section, step), values in by_step.items():
            run.log({f"{section}/step": step, **values})
    finally:
        run.finish()


WRITERS: dict[str, Callable[[ObjectStore, int, str, Sequence[Scalar]], None]] = {
    "tensorboard": _to_tensorboard,
    "wandb": _to_wandb,
}
