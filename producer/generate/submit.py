"""Writing a generation run: the run and all its jobs in one transaction, streamed in chunks,
each job written once, as `queued`: the jobs table is the outbox.

Rows are read, checked, planned and inserted a chunk at a time, so memory stays flat
whatever the size of the prompt file; a problem anywhere rolls the whole run back, so a
bad file writes nothing. The messages are sent after the commit (the outbox).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import chunked, copy_rows, insert_rows
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import stored_outputs, utcnow
from sdq.models.jobs.outbox import job_row, record_submitted
from sdq.models.registry import record_model
from sdq.models.specs import GenerationSpec, ModelIdentity
from sdq.models.tables import Job, Run
from sdq.models.tables.generate import Generation
from sdq.producer.generate.plan import PlannedJob

CHUNK = 5_000


@dataclass(frozen=True)
class Batching:
    batch_size: int  # images per pipeline call
    calls_per_task: int  # pipeline calls per task message

    @property
    def jobs_per_message(self) -> int:
        return self.batch_size * self.calls_per_task


@dataclass(frozen=True)
class Submission:
    run_id: int
    jobs: int
    cached: int


def record_run(
    sessions: sessionmaker[Session],
    planned: Iterable[PlannedJob],
    *,
    model: ModelIdentity,
    source: str,
    options: dict[str, Any],
    batching: Batching,
) -> Submission:
    """Writes the run and its jobs; specs rendered before are recorded as cached, not sent."""
    now = utcnow()
    with sessions.begin() as session:
        record_model(session, model)
        run = Run(
            kind=GENERATE.name,
            source=source,
            options=options,
            job_count=0,
            jobs_per_message=batching.jobs_per_message,
            task_options={"batch_size": batching.batch_size},
        )
        session.add(run)
        session.flush()
        jobs = cached = 0
        batch_keys = BatchKeys()
        for chunk in chunked(planned, CHUNK):
            jobs += len(chunk)
            cached += _insert_jobs(session, run.id, chunk, batch_keys, now)
        run.job_count = jobs
        record_submitted(session, run.id, cached=cached, now=now)
    return Submission(run.id, jobs, cached)


class BatchKeys(dict[tuple[Any, ...], str]):
    """Batch keys computed once per distinct setting: most rows of a run share one. The
    model's revision and scheduler name decide its scheduler config, the key's one
    unhashable part, so this tuple decides the key."""

    def of(self, spec: GenerationSpec) -> str:
        settings = (
            spec.model_revision,
            spec.model_source,
            spec.scheduler,
            spec.steps,
            spec.guidance,
            spec.width,
            spec.height,
            spec.dtype,
        )
        if settings not in self:
            self[settings] = spec.batch_key()
        return self[settings]


def _insert_jobs(
    session: Session, run_id: int, planned: list[PlannedJob], batch_keys: BatchKeys, now: datetime
) -> int:
    """Inserts one chunk; returns how many of its jobs were served from the cache."""
    # Messages take jobs in id order: ids in batch-key order make each message's jobs
    # share pipeline calls.
    keyed = sorted(((batch_keys.of(job.spec), job) for job in planned), key=lambda pair: pair[0])
    hashes = [job.spec.hash() for _, job in keyed]
    known = stored_outputs(session, hashes)
    rows = [
        job_row(run_id, GENERATE, job.spec.to_dict(), spec_hash, known.get(spec_hash), now)
        for (_, job), spec_hash in zip(keyed, hashes, strict=True)
    ]
    ids = insert_rows(session, Job.__table__, rows)
    copy_rows(
        session,
        Generation.__table__,
        [_generation_row(job_id, job, key) for job_id, (key, job) in zip(ids, keyed, strict=True)],
    )
    return sum(row["cached"] for row in rows)


def _generation_row(job_id: int, job: PlannedJob, batch_key: str) -> dict[str, Any]:
    spec = job.spec
    return {
        "job_id": job_id,
        "prompt": spec.prompt,
        "style": job.style,
        "model": spec.model_name,
        "seed": spec.seed,
        "source_line": job.source_line,
        "batch_key": batch_key,
    }
