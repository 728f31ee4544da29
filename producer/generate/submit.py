"""Writing a generation run: the run and all its jobs in one transaction, streamed in chunks,
each job written once, as `queued`: the jobs table is the outbox.

Rows are read, checked, planned and inserted a chunk at a time, so memory stays flat
whatever the size of the prompt file; a problem anywhere rolls the whole run back, so a
bad file writes nothing. The messages are sent after the commit (the outbox).
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import chunked
from sdq.models.generations import BatchKeys, PlannedJob, insert_generation_jobs
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.outbox import record_submitted
from sdq.models.registry import record_model
from sdq.models.specs import ModelIdentity
from sdq.models.tables import Run

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
            cached += insert_generation_jobs(session, run.id, chunk, batch_keys, now)
        run.job_count = jobs
        record_submitted(session, run.id, cached=cached, now=now)
    return Submission(run.id, jobs, cached)
