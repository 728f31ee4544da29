"""Questions the train commands ask of the database: which run a number names, the base it
trained on, its last step, what its checkpoints asked for (and which of it died), and
what each train-shard job covers. Where a run stands is models/train/status.py's."""

from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select
from sqlalchemy.orm import Session

from sdq.models.jobs.kinds import TRAIN
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.specs import ModelIdentity
from sdq.models.store import ObjectStore
from sdq.models.tables import Job, JobStatus, Run
from sdq.models.train.tables import Checkpoint, TrainStep
from sdq.producer.errors import NotFound


def train_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no train run {run_id}")
    if run.kind != TRAIN.name:
        raise NotFound(f"run {run_id} is not a train run (its kind: {run.kind}): `sdq status "
                       f"{run_id}` shows it")  # fmt: skip
    return run


def spec_fields(spec: dict[str, Any]) -> dict[str, Any]:
    """A job's steps, from its spec."""
    return {"steps": f"{spec['first_step'] + 1}-{spec['last_step']}"}


def run_base(session: Session, run_id: int, *, store: ObjectStore) -> ModelIdentity:
    """The base model train run RUN trained on, as it was then: a run that goes on from it
    trains on the same VAE and text encoder's latents."""
    run = train_run(session, run_id)
    identity = resolve_model(run.options["base"], store=store, session=session)
    if identity.revision != run.options["base_revision"]:
        raise ModelNotFound(
            f"train run {run_id} trained on {run.options['base']!r} at revision "
            f"{run.options['base_revision'][:12]}; that name is now {identity.revision[:12]}"
        )
    return identity


def latest_step(session: Session, run_id: int, since: datetime | None = None) -> int:
    """The last optimizer step recorded: ahead of the last checkpoint while a job runs.
    `since`: the last taken since then, else the last checkpoint's: steps a stopped run
    took past its checkpoint are taken again, and are not where a resumed run stands."""
    taken = select(func.max(TrainStep.step)).where(TrainStep.run_id == run_id)
    if since is None:
        return session.scalar(taken) or 0
    checkpointed = select(func.max(Checkpoint.step)).where(Checkpoint.run_id == run_id)
    return session.scalar(taken.where(TrainStep.at >= since)) or session.scalar(checkpointed) or 0


def last_step_at(session: Session, run_id: int) -> datetime | None:
    """When the run's last recorded step ended, by the clock of the worker that took it."""
    return session.scalar(select(func.max(TrainStep.at)).where(TrainStep.run_id == run_id))


def runs_asked_for(session: Session, run_id: int) -> list[tuple[int, int]]:
    """(run id, jobs) of what the train run's checkpoints asked for and is not finished
    yet, in the order it was asked: validation renders, evaluations' renders and their
    evaluate jobs."""
    return [
        (asked_for.id, asked_for.job_count)
        for asked_for in session.scalars(
            select(Run).where(Run.finished_at.is_(None), _asked_by(run_id)).order_by(Run.id)
        )
    ]


def dead_asked_for(session: Session, run_id: int) -> list[dict[str, Any]]:
    """What the train run's checkpoints asked for that has dead jobs (an evaluation whose
    FID weights are not Inception's, say): each such run, what it is, and its first dead
    job's id and error."""
    first_dead = (
        select(Run.id, Run.source, func.min(Job.id).label("job_id"))
        .join(Job, Job.run_id == Run.id)
        .where(_asked_by(run_id), Job.status == JobStatus.dead)
        .group_by(Run.id, Run.source)
        .order_by(Run.id)
    )
    return [
        {"run_id": run, "of": source, "job_id": job_id,
         "error": session.scalar(select(Job.error).where(Job.id == job_id))}
        for run, source, job_id in session.execute(first_dead)
    ]  # fmt: skip


def _asked_by(run_id: int) -> ColumnElement[bool]:
    """Runs a train run's checkpoints asked for: validation renders, evaluations' renders
    and their evaluate jobs."""
    return or_(
        Run.options["validation_of"].as_integer() == run_id,
        Run.options["evaluation_of"].as_integer() == run_id,
    )
