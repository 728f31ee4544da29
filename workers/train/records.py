"""What a train-shard job writes to the database with its checkpoint, in one transaction:
the steps' losses, the checkpoint's row, the model's registration, the run's next job and
the checkpoint's validation renders."""

from dataclasses import replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from sdq.models.db import insert_rows, upsert
from sdq.models.generations import (
    PlannedJob,
    SharedSettings,
    insert_generation_jobs,
    prepare_chunk,
)
from sdq.models.jobs.kinds import GENERATE, TRAIN
from sdq.models.jobs.lifecycle import record_events, utcnow
from sdq.models.jobs.outbox import job_row, record_submitted
from sdq.models.registry import STORE_SOURCE, record_stored_model
from sdq.models.specs import GenerationSpec
from sdq.models.tables import Job, JobStatus, Run
from sdq.models.tables.train import Checkpoint, TrainStep
from sdq.models.training import TrainShardSpec


def checkpoint_at(session: Session, run: int, step: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run, Checkpoint.step == step)
    ).one_or_none()


def record_checkpoint(
    session: Session,
    spec: TrainShardSpec,
    steps: list[dict[str, Any]],
    *,
    uri: str,
    prefix: str,
    revision: str,
) -> list[int]:
    """Returns the runs given new jobs: this one (its next job) and a validation run."""
    step = spec.last_step
    if steps:
        # Steps a killed worker had done are done again, with the same numbers.
        insert = upsert(session, TrainStep).values(steps)
        session.execute(
            insert.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={name: insert.excluded[name] for name in ("loss", "lr", "samples_per_second")},
            )
        )
    model_prefix = f"{prefix}/model"
    written = session.execute(
        upsert(session, Checkpoint)
        .values(
            run_id=spec.run,
            step=step,
            uri=uri,
            model_prefix=model_prefix,
            model_revision=revision,
        )
        .on_conflict_do_nothing(index_elements=["run_id", "step"])
        .returning(Checkpoint.id)
    ).first()
    record_stored_model(session, spec.model_name, model_prefix, revision)
    if written is None:
        return [spec.run]  # a second writer of this checkpoint: the rest is written already
    new_work = []
    if spec.validation is not None:
        model = (f"{spec.model_name}@{step}", f"{STORE_SOURCE}{model_prefix}", revision)
        new_work.append(_validation_run(session, spec, step, model))
    if step < spec.options.steps:
        _next_job(session, spec)
        new_work.append(spec.run)
    return new_work


def _next_job(session: Session, spec: TrainShardSpec) -> None:
    step = spec.last_step
    after = replace(
        spec,
        first_step=step,
        last_step=min(step + spec.options.checkpoint_every, spec.options.steps),
    )
    now = utcnow()
    [job_id] = insert_rows(
        session,
        Job.__table__,
        [job_row(spec.run, TRAIN, after.to_dict(), after.hash(), None, now)],
    )
    record_events(session, [job_id], JobStatus.queued, at=now)


def _validation_run(
    session: Session, spec: TrainShardSpec, step: int, model: tuple[str, str, str]
) -> int:
    """A generation run of the validation prompts from this checkpoint's model."""
    validation = spec.validation
    name, source, revision = model
    planned = [
        PlannedJob(
            spec=GenerationSpec(
                model_name=name,
                model_source=source,
                model_revision=revision,
                scheduler=validation.scheduler,
                scheduler_config=spec.scheduler_config,
                prompt=prompt,
                negative_prompt="",
                seed=seed,
                steps=validation.steps,
                guidance=validation.guidance,
                width=validation.size,
                height=validation.size,
                dtype=validation.dtype,
            ),
            style=None,
            source_line=line,
            subject=prompt,
        )
        for line, (prompt, seed) in enumerate(validation.prompts, start=1)
    ]
    run = Run(
        kind=GENERATE.name,
        source=f"validation of train run {spec.run} at step {step}",
        options={"validation_of": spec.run, "step": step},
        job_count=len(planned),
        jobs_per_message=len(planned),
        task_options={"batch_size": len(planned)},
    )
    session.add(run)
    session.flush()
    now = utcnow()
    cached = insert_generation_jobs(session, run.id, prepare_chunk(planned, SharedSettings()), now)
    record_submitted(session, run.id, cached=cached)
    return run.id
