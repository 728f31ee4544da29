"""What a train-shard job writes to the database with its checkpoint, in one transaction:
the steps' losses, the checkpoint's row, the model's registration, the run's next job and
the checkpoint's validation renders."""

import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from time import monotonic
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import finite_or_null, upsert
from sdq.models.evaluate.runs import ScoredModel, open_evaluation
from sdq.models.generate.generations import open_render_run
from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.outbox import write_jobs
from sdq.models.loras import lora_record
from sdq.models.registry import STORE_SOURCE, record_lora, record_stored_model
from sdq.models.tables import Run
from sdq.models.train.specs import TrainShardSpec, checkpoint_prefix, lora_file_key
from sdq.models.train.tables import Checkpoint, TrainStep

logger = logging.getLogger(__name__)

# What a step redone by a later attempt writes again (the same, but for when it ended).
STEP_FIGURES = ("loss", "lr", "samples_per_second", "world_size", "mfu", "data_wait_seconds",
                "bucket", "at")  # fmt: skip


@dataclass(frozen=True)
class Written:
    """A checkpoint in the store: its training state, and the pipeline when it is a model."""

    step: int
    uri: str
    state_sha256: str
    model_prefix: str | None
    model_revision: str | None
    seconds: float | None = None  # how long the training waited for it


def checkpoint_at(session: Session, run: int, step: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == run, Checkpoint.step == step)
    ).one_or_none()


def checkpoint_within(session: Session, run: int, after: int, until: int) -> Checkpoint | None:
    """The run's newest checkpoint past step `after`, up to step `until`."""
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == run, Checkpoint.step > after, Checkpoint.step <= until)
        .order_by(Checkpoint.step.desc())
        .limit(1)
    ).one_or_none()


def record_steps(session: Session, steps: list[dict[str, Any]]) -> None:
    """The steps' figures. A step written again (by the job's end after its live record, or
    by a later attempt after a killed worker) has the same numbers."""
    if steps:
        rows = [_step_row(step) for step in steps]
        # One multi-row statement, unlike `upsert`'s other callers: given as an executemany,
        # a job stopped at its time limit ended its run without a checkpoint
        # (tests/test_train.py::test_a_job_runs_under_its_worker_s_time_limit_not_its_sender_s).
        insert = upsert(session, TrainStep).values(rows)
        session.execute(
            insert.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={name: insert.excluded[name] for name in STEP_FIGURES},
            )
        )


def _step_row(step: dict[str, Any]) -> dict[str, Any]:
    at = datetime.fromtimestamp(step["at"], UTC)
    return {**step, "loss": finite_or_null(step["loss"]), "at": at}


class LiveSteps:
    """Steps written to the database as they are taken, a few seconds' worth at a time, so
    that `sdq train status` and the bars move between checkpoints. What the database cannot
    take now waits for the next write; the job's end writes every step again anyway."""

    def __init__(self, sessions: sessionmaker[Session], every_seconds: float) -> None:
        self.sessions, self.every_seconds = sessions, every_seconds
        self._pending: list[dict[str, Any]] = []
        self._written = float("-inf")

    def __call__(self, steps: list[dict[str, Any]]) -> None:
        self._pending += steps
        # A loss that is not finite may end the job dead (loop/diverged.py) before the next
        # write, and no checkpoint writes its steps: they go now.
        diverging = any(not math.isfinite(step["loss"]) for step in steps)
        if diverging or monotonic() - self._written >= self.every_seconds:
            self.write()

    def write(self) -> None:
        try:
            with self.sessions.begin() as session:
                record_steps(session, self._pending)
        except DBAPIError as error:
            logger.warning("steps kept to write later: %r", error)
        else:
            self._pending = []
        self._written = monotonic()


def record_checkpoint(
    session: Session, spec: TrainShardSpec, steps: list[dict[str, Any]], written: Written
) -> list[int]:
    """Returns the runs given new jobs: this one (its next job), a validation run and an
    evaluation's runs."""
    record_steps(session, steps)
    inserted = session.execute(
        upsert(session, Checkpoint)
        .values(
            run_id=spec.run,
            step=written.step,
            uri=written.uri,
            state_sha256=written.state_sha256,
            model_prefix=written.model_prefix,
            model_revision=written.model_revision,
            write_seconds=written.seconds,
        )
        .on_conflict_do_nothing(index_elements=["run_id", "step"])
        .returning(Checkpoint.id)
    ).first()
    if written.model_prefix is not None:
        _register_model(session, spec, written)
    if inserted is None:
        return [spec.run]  # a second writer of this checkpoint: the rest is written already
    new_work = []
    model = (
        f"{spec.model_name}@{written.step}",
        f"{STORE_SOURCE}{written.model_prefix}",
        written.model_revision,
    )
    if spec.validation is not None:
        new_work.append(_validation_run(session, spec, written))
    if written.model_prefix is not None and spec.evaluates(written.step):
        # Scored on the evaluate queue: the run's next job is sent whether or not it is.
        scored = ScoredModel(*model, spec.scheduler_config, run=spec.run, step=written.step)
        new_work += open_evaluation(session, scored, spec.evaluation)
    if written.step < spec.options.steps:
        _next_job(session, spec, written.step)
        new_work.append(spec.run)
    return new_work


def prune_checkpoints(session: Session, spec: TrainShardSpec, *, deleted_at: datetime) -> list[str]:
    """Marks the run's checkpoints older than its newest --keep-checkpoints deleted;
    returns their prefixes in the store."""
    kept = (
        select(Checkpoint.step)
        .where(Checkpoint.run_id == spec.run)
        .order_by(Checkpoint.step.desc())
        .limit(spec.options.keep_checkpoints)
    )
    old = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == spec.run, Checkpoint.deleted_at.is_(None))
        .where(Checkpoint.step.not_in(kept))
    ).all()
    for checkpoint in old:
        checkpoint.deleted_at = deleted_at
    return [checkpoint_prefix(spec.run, checkpoint.step) for checkpoint in old]


def _next_job(session: Session, spec: TrainShardSpec, step: int) -> None:
    """The job after one that ended at `step`: its last planned step, or an earlier one
    where it stopped for its time limit (the run then has one job more than planned)."""
    if step < spec.last_step:
        run = session.get(Run, spec.run)
        run.job_count += 1
    after = spec.next_after(step)
    write_jobs(session, spec.run, TRAIN, [after.to_dict()], [after.hash()], utcnow())


def _register_model(session: Session, spec: TrainShardSpec, written: Written) -> None:
    """The checkpoint's model as the newest under the run's name: a pipeline that `--model
    NAME` loads, or the LoRA file that `--lora NAME` renders with."""
    if spec.options.lora:
        key = lora_file_key(written.model_prefix)
        record_lora(session, spec.model_name, key, written.model_revision)
    else:
        record_stored_model(session, spec.model_name, written.model_prefix, written.model_revision)


def _validation_run(session: Session, spec: TrainShardSpec, written: Written) -> int:
    """A generation run of the validation prompts from this checkpoint's model: its
    pipeline, or the base's with its LoRA."""
    step, name = written.step, f"{spec.model_name}@{written.step}"
    if spec.options.lora:
        model = (spec.base_name, spec.base_source, spec.base_revision)
        key = f"{STORE_SOURCE}{lora_file_key(written.model_prefix)}"
        loras = (lora_record(name, key, written.model_revision),)
    else:
        model, loras = (name, f"{STORE_SOURCE}{written.model_prefix}", written.model_revision), ()
    return open_render_run(
        session,
        spec.validation.specs(model, spec.scheduler_config, loras),
        source=f"validation of train run {spec.run} at step {step}",
        options={"validation_of": spec.run, "step": step},
    )
