"""Writing an evaluation: one model's renders (a generation run, when a metric needs them)
and its evaluate job, in the caller's transaction; a train job writes one with each
checkpoint it scores, `sdq evaluate` one for any model."""

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from sdq.models.evaluate.specs import RENDERED, EvaluateSpec, Evaluation
from sdq.models.generate.generations import open_render_run
from sdq.models.jobs.kinds import EVALUATE
from sdq.models.jobs.outbox import add_jobs, open_run


@dataclass(frozen=True)
class ScoredModel:
    """The model an evaluation scores, and where its scores belong: a train run's step, or
    no run (a model by name)."""

    name: str
    source: str
    revision: str
    scheduler_config: dict[str, Any]
    run: int | None = None
    step: int | None = None

    @property
    def described(self) -> str:
        if self.run is None:
            return f"model {self.name}"
        return f"train run {self.run} at step {self.step}"


def open_evaluation(session: Session, model: ScoredModel, evaluation: Evaluation) -> list[int]:
    """The evaluation's runs, to send: its renders first, then its evaluate job's."""
    runs, renders = [], ()
    if evaluation.rendering is not None and RENDERED & set(evaluation.metrics):
        specs = evaluation.rendering.specs(
            (model.name, model.source, model.revision), model.scheduler_config
        )
        source = f"evaluation renders of {model.described}"
        runs.append(open_render_run(session, specs, source=source, options=_about(model)))
        renders = tuple(spec.hash() for spec in specs)
    spec = EvaluateSpec(
        model_name=model.name,
        model_source=model.source,
        model_revision=model.revision,
        evaluation=evaluation,
        renders=renders,
        run=model.run,
        step=model.step,
    )
    run = open_run(session, EVALUATE, source=f"evaluation of {model.described}",
                   options=_about(model))  # fmt: skip
    add_jobs(session, run, EVALUATE, [spec])
    return [*runs, run.id]


def _about(model: ScoredModel) -> dict[str, Any]:
    """What an evaluation's runs record: the run and step scored (the train run's page and
    status find them by it), or the model."""
    return {"evaluation_of": model.run, "step": model.step, "model": model.name,
            "model_revision": model.revision}  # fmt: skip
