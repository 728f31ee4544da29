"""Writing a generation run: the run and all its jobs in one transaction, streamed in chunks,
each job written once, as `queued`: the jobs table is the outbox.

Rows are read, checked, planned and inserted a chunk at a time, so memory stays flat
whatever the size of the prompt file; a problem anywhere rolls the whole run back, so a
bad file writes nothing. The messages are sent after the commit (the outbox).
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.ahead import run_ahead
from sdq.models.db import chunked
from sdq.models.generate.generations import (
    PlannedJob,
    SharedSettings,
    insert_generation_jobs,
    prepare_chunk,
)
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.jobs.outbox import open_run, record_submitted
from sdq.models.registry import record_model
from sdq.models.specs import ModelIdentity

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
    on_written: Callable[[int], None] = lambda jobs: None,
    waited: bool = False,
) -> Submission:
    """Writes the run and its jobs, telling `on_written` how many each chunk held; specs
    rendered before are recorded as cached, not sent. A run someone `waited` for (a
    request) says so in its messages' options: they travel on the kind's lane."""
    now = utcnow()
    with sessions.begin() as session:
        record_model(session, model)
        run = open_run(
            session,
            GENERATE,
            source=source,
            options=options,
            jobs_per_message=batching.jobs_per_message,
            task_options={
                "batch_size": batching.batch_size,
                **({"waited": True} if waited else {}),
            },
        )
        jobs = cached = 0
        settings = SharedSettings()
        chunks = (prepare_chunk(chunk, settings) for chunk in chunked(planned, CHUNK))
        # Each next chunk read, planned and hashed on a thread while the database takes in
        # this one; an error in the file is raised here, in the transaction, rolled back.
        for chunk in run_ahead(chunks):
            jobs += len(chunk.jobs)
            cached += insert_generation_jobs(session, run.id, chunk, now)
            on_written(len(chunk.jobs))
        run.job_count = jobs
        record_submitted(session, run.id, cached=cached)
    return Submission(run.id, jobs, cached)
