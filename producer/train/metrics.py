"""What `sdq metrics` shows of training (the kind's ProducerHooks.metrics): each train run's
latest step, speed and loss, while it runs and for a while after."""

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.tables import Run
from sdq.models.train.tables import TrainStep

# prometheus_client is the `monitor` extra's: imported where `sdq metrics` scrapes, never
# by the command line's start (this module is the train kind's hook).
if TYPE_CHECKING:
    from prometheus_client.core import Metric

# A finished run's figures stay on the scrape this long, for a dashboard to show its end.
SHOWN_AFTER_ITS_END = timedelta(hours=1)
GAUGES = {
    "step": ("sdq_train_step", "The train run's latest step"),
    "samples_per_second": ("sdq_train_samples_per_second", "The latest step's samples/s"),
    "loss": ("sdq_train_loss", "The latest step's training loss"),
}


def train_gauges(session: Session, _app: Any = None) -> Iterator["Metric"]:
    from prometheus_client.core import GaugeMetricFamily

    families = {key: GaugeMetricFamily(name, text, labels=["run"])
                for key, (name, text) in GAUGES.items()}  # fmt: skip
    shown = or_(Run.finished_at.is_(None), Run.finished_at >= utcnow() - SHOWN_AFTER_ITS_END)
    latest = (
        select(TrainStep.run_id, func.max(TrainStep.step).label("step"))
        .join(Run, Run.id == TrainStep.run_id)
        .where(Run.kind == TRAIN.name, shown)
        .group_by(TrainStep.run_id)
        .subquery()
    )
    rows = session.execute(
        select(TrainStep.run_id, TrainStep.step, TrainStep.samples_per_second, TrainStep.loss).join(
            latest, (latest.c.run_id == TrainStep.run_id) & (latest.c.step == TrainStep.step)
        )
    )
    for run_id, step, speed, loss in rows:
        # A loss that is not finite (NULL) is the exposition format's NaN: a diverged run.
        loss = math.nan if loss is None else loss
        for key, value in (("step", step), ("samples_per_second", speed), ("loss", loss)):
            families[key].add_metric([str(run_id)], value)
    yield from families.values()
