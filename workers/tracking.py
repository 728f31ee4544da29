"""A run's figures for the trackers people watch training in (`--report-to`). A tracker
that fails never fails the work: every figure is in SQL anyway.

- tensorboard: event files in the store under runs/<run>/tensorboard/, one per train-shard
  job (its steps) and one per evaluation (its scores and its first renders), each named by
  what it holds, so that an attempt done again rewrites its file instead of adding a twin.
  TensorBoard reads the folder (synced from S3, or a local store's) as one run.
- wandb: the W&B run `sdq-run-<run>`, which every job of the run resumes, in the project
  WANDB_PROJECT names (else "sdq"); W&B's own variables (WANDB_API_KEY, WANDB_MODE,
  WANDB_DIR, WANDB_ENTITY) decide the rest."""

import io
import logging
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sdq.models.store import ObjectStore

logger = logging.getLogger(__name__)

# (tag, step, value): "train/loss", 120, 0.093. A tag's section ("train") is its chart group.
Scalar = tuple[str, int, float]
# (tag, step, PNG): "renders/0", 120, b"\x89PNG...": one image a tag, a slider over steps.
Picture = tuple[str, int, bytes]


def tensorboard_key(run_id: int, name: str) -> str:
    return f"runs/{run_id}/tensorboard/events.out.tfevents.{name}"


def report(
    store: ObjectStore,
    run_id: int,
    name: str,
    scalars: Sequence[Scalar],
    trackers: Sequence[str],
    pictures: Sequence[Picture] = (),
) -> None:
    """The scalars and pictures, to each tracker the run reports to; `name` says what they
    are (a job's steps, a checkpoint's scores and renders)."""
    for tracker in trackers:
        try:
            WRITERS[tracker](store, run_id, name, scalars, pictures)
        except Exception:
            logger.exception("run %s: %s not sent to %s", run_id, name, tracker)


def _pixels(png: bytes):
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        return image.convert("RGB")


def _to_tensorboard(
    store: ObjectStore, run_id: int, name: str, scalars: Sequence[Scalar],
    pictures: Sequence[Picture],
) -> None:  # fmt: skip
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter  # only where a run reports to it

    with tempfile.TemporaryDirectory(prefix="sdq-tensorboard-") as folder:
        writer = SummaryWriter(log_dir=folder)
        for tag, step, value in scalars:
            writer.add_scalar(tag, value, step)
        for tag, step, png in pictures:
            writer.add_image(tag, np.asarray(_pixels(png)), step, dataformats="HWC")
        writer.close()
        [written] = Path(folder).glob("events.out.tfevents.*")
        store.put_bytes(tensorboard_key(run_id, name), written.read_bytes(),
                        content_type="application/octet-stream")  # fmt: skip


def _to_wandb(
    _store: ObjectStore, run_id: int, _name: str, scalars: Sequence[Scalar],
    pictures: Sequence[Picture],
) -> None:  # fmt: skip
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
        by_step: dict[tuple[str, int], dict[str, Any]] = defaultdict(dict)
        for tag, step, value in scalars:
            by_step[tag.partition("/")[0], step][tag] = value
        for tag, step, png in pictures:
            by_step[tag.partition("/")[0], step][tag] = wandb.Image(_pixels(png))
        for section in {section for section, _ in by_step}:
            run.define_metric(f"{section}/step", hidden=True)
            run.define_metric(f"{section}/*", step_metric=f"{section}/step")
        for (section, step), values in by_step.items():
            run.log({f"{section}/step": step, **values})
    finally:
        run.finish()


Writer = Callable[[ObjectStore, int, str, Sequence[Scalar], Sequence[Picture]], None]
WRITERS: dict[str, Writer] = {
    "tensorboard": _to_tensorboard,
    "wandb": _to_wandb,
}
