"""Writing a generation run: the run and all its jobs in one transaction, streamed in chunks,
each job written once, as `queued`: the jobs table is the outbox.

Rows are read, checked, planned and inserted a chunk at a time, so memory stays flat
whatever the size of the prompt file; a problem anywhere rolls the whole run back, so a
bad file writes nothing. The messages are sent after the commit (the outbox).

Each next chunk is read, planned and hashed on a thread while the database takes in this
one. On Postgres that thread also draws the chunk's job ids from their sequence, looks up
the outputs stored for its specs and formats its rows as COPY's text, from the second
chunk on over a connection of its own: the writer's transaction only copies them in, and
the database works on both connections at once (docs/performance.md has the figures).
Nothing that connection does is part of the run: the ids of a run rolled back are left
unused.
"""

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from itertools import islice
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.ahead import run_ahead
from sdq.models.db import chunked
from sdq.models.generate.generations import (
    Chunk,
    DrawnChunk,
    PlannedJob,
    SharedSettings,
    copy_drawn_chunk,
    draw_chunk,
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
        # An error in the file is raised here, in the transaction, rolled back.
        for count, served in _write_chunks(sessions, session, run.id, chunks, now):
            jobs += count
            cached += served
            on_written(count)
        run.job_count = jobs
        record_submitted(session, run.id, cached=cached)
    return Submission(run.id, jobs, cached)


def _write_chunks(
    sessions: sessionmaker[Session],
    session: Session,
    run_id: int,
    chunks: Iterator[Chunk],
    now: datetime,
) -> Iterator[tuple[int, int]]:
    """Writes each chunk in the session's transaction, the next made ready on a thread
    meanwhile (see above); yields each one's jobs and those served from the cache."""
    if session.get_bind().dialect.name != "postgresql":
        for chunk in run_ahead(chunks):
            yield len(chunk.jobs), insert_generation_jobs(session, run_id, chunk, now)
        return
    for drawn in run_ahead(_drawn_chunks(sessions, session, run_id, chunks, now)):
        yield len(drawn.jobs.ids), copy_drawn_chunk(session, run_id, drawn, now)


def _drawn_chunks(
    sessions: sessionmaker[Session],
    writer: Session,
    run_id: int,
    chunks: Iterator[Chunk],
    now: datetime,
) -> Iterator[DrawnChunk]:
    """The chunks drawn (generations.draw_chunk), on the thread ahead of the writer. The
    first on the writer's own session, which waits for it meanwhile: a run of one chunk
    (an image request to `sdq serve`, many at once) holds one connection, not two."""
    chunks = iter(chunks)
    for chunk in islice(chunks, 1):
        yield draw_chunk(writer, run_id, chunk, now)
    for chunk in chunks:
        # A transaction a chunk: the connection goes back to the pool between them.
        with sessions.begin() as drawing:
            drawn = draw_chunk(drawing, run_id, chunk, now)
        yield drawn
