"""A run's scores as the commands read them: each metric's curve over the steps, and the
best step by a metric among those that hold what a caller needs."""

from collections import defaultdict
from collections.abc import Collection

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.evaluate.specs import METRICS, best_of
from sdq.models.evaluate.tables import CheckpointScore


class NoScores(Exception):
    pass


def run_scores(session: Session, run_id: int) -> dict[str, list[tuple[int, float | None]]]:
    """{metric: [(step, value), ...]} of the train run's checkpoints, in step order (a
    step scored again, by a later evaluation of the same checkpoint, by its latest)."""
    rows = session.execute(
        select(CheckpointScore.metric, CheckpointScore.step, CheckpointScore.value)
        .where(CheckpointScore.run_id == run_id)
        .order_by(CheckpointScore.step, CheckpointScore.id)
    ).all()
    curves: dict[str, dict[int, float | None]] = defaultdict(dict)
    for metric, step, value in rows:
        curves[metric][step] = value
    return {metric: sorted(curve.items()) for metric, curve in curves.items()}


def score_text(value: float | None) -> str:
    """A score as the screens print it; None is one that was not a finite number."""
    return "not finite" if value is None else f"{value:.4f}"


def best_step(session: Session, run_id: int, metric: str, among: Collection[int]) -> int:
    """The step of the run's best `metric` among the steps `among` (those whose checkpoint
    holds what the caller needs: a state to resume from, a model to render with)."""
    if metric not in METRICS:
        raise NoScores(f"no metric {metric!r}; the metrics are {', '.join(METRICS)}")
    scores = run_scores(session, run_id)
    curve = dict(scores.get(metric, []))
    usable = {step: value for step, value in curve.items() if step in among}
    if not curve:
        raise NoScores(
            f"train run {run_id} has no {metric} score at any step (the metrics it was scored "
            f"on: {', '.join(sorted(scores)) or 'none'})"
        )
    if not usable:
        raise NoScores(
            f"train run {run_id} has no {metric} score for a checkpoint that is still there "
            f"(steps scored: {', '.join(map(str, curve))}; with checkpoints at: "
            f"{', '.join(map(str, among)) or 'none'})"
        )
    best = best_of(metric, usable)
    if best is None:
        raise NoScores(
            f"train run {run_id}'s {metric} is not finite at every checkpoint still there "
            f"(steps {', '.join(map(str, usable))}): the model diverged; pick a step by hand"
        )
    return best
