"""The outbox: the jobs table itself. A run's jobs are committed as `queued` (committed
for delivery) in one transaction, and their task messages are sent after the commit.

Nothing is written per job after the send, so submitting stays one pass over the rows.
If the broker refuses, the jobs it did not take go back to `pending`. If the process dies
between the commit and the last message, its jobs stay `queued` with no worker claiming
them. Either way any later send (`sdq requeue`, the periodic relay) finds them: nothing
is lost, and a job sent twice is claimed once.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import CopyText, chunked, copy_in, drawn_rows, in_index_order, insert_rows
from sdq.models.jobs.kinds import Kind, kind_named
from sdq.models.jobs.lifecycle import (
    close_runs,
    mark_queued,
    mark_unsent,
    record_events_of,
    stored_outputs,
    utcnow,
)
from sdq.models.tables import FINISHED, Job, JobStatus, Run

# Job ids read per query and marked queued per statement: memory stays bounded whatever
# the size of the run.
PAGE = 10_000

# Sends task messages of one kind: the job ids each carries, and their keyword arguments.
# It returns once the broker has taken them all; if it raises, any of them may or may not
# have been taken (a job sent twice is claimed once, so they are sent again).
Send = Callable[[Kind, list[list[int]], dict[str, Any]], None]


class EnqueueFailed(Exception):
    def __init__(self, run_id: int, sent: int, cause: Exception) -> None:
        super().__init__(
            f"run {run_id}: the broker took {sent} messages, then failed ({cause}); the "
            f"jobs not sent are saved as pending: `sdq requeue {run_id}` sends them when "
            "the broker is back"
        )


@dataclass(frozen=True)
class Sent:
    jobs: int
    messages: int


# What a job served from the cache at submit says in its history.
CACHED = "cached: output made before"


def job_row(
    run_id: int,
    kind: Kind,
    spec: dict[str, Any],
    spec_hash: str,
    known: tuple[str, str] | None,
    now: datetime,
) -> dict[str, Any]:
    """A new job as submit writes it: committed for delivery (`queued`, the messages follow
    the commit), or already succeeded when an output for its spec hash is stored."""
    uri, digest = known or (None, None)
    return {
        "run_id": run_id,
        "kind": kind.name,
        "spec": spec,
        "spec_hash": spec_hash,
        "status": JobStatus.succeeded if known else JobStatus.queued,
        "enqueued_at": None if known else now,
        "attempts": 0,
        "cached": known is not None,
        "output_uri": uri,
        "output_sha256": digest,
        "finished_at": now if known else None,
    }


def record_first_events(
    session: Session, run_id: int, job_ids: list[int], *, cached: int, now: datetime
) -> None:
    """The history's first rows for jobs just written, by the database itself: queued, or
    succeeded from the cache. Written per chunk, so the database works on them while the
    next chunk is planned."""
    written = (Job.run_id == run_id) & Job.id.between(min(job_ids), max(job_ids))
    record_events_of(session, written & ~Job.cached, JobStatus.queued, at=now)
    if cached:
        record_events_of(session, written & Job.cached, JobStatus.succeeded, detail=CACHED, at=now)


def record_submitted(session: Session, run_id: int, *, cached: int) -> None:
    """A run served wholly from the cache is finished as it is written."""
    if cached:
        close_runs(session, [run_id])


def open_run(
    session: Session,
    kind: Kind,
    *,
    source: str,
    options: dict[str, Any],
    jobs_per_message: int = 1,
    task_options: dict[str, Any] | None = None,
    job_count: int = 0,
) -> Run:
    """A new run of the kind, in the session with its id: its jobs are written next. How its
    jobs travel (ids per message, the task's keyword arguments) is kept with it, so a
    re-send makes the same messages."""
    run = Run(
        kind=kind.name,
        source=source,
        options=options,
        job_count=job_count,
        jobs_per_message=jobs_per_message,
        task_options=task_options or {},
    )
    session.add(run)
    session.flush()
    return run


class Spec(Protocol):
    def to_dict(self) -> dict[str, Any]: ...
    def hash(self) -> str: ...


@dataclass(frozen=True)
class Written:
    ids: list[int]  # in the specs' order
    cached: int  # how many were done as they were written


def write_jobs(
    session: Session,
    run_id: int,
    kind: Kind,
    specs: Sequence[dict[str, Any]],
    hashes: Sequence[str],
    now: datetime,
) -> Written:
    """The one writer of jobs: a job per spec (as stored, with its hash), and its first
    history row; a job whose output is stored already is done as it is written. On
    Postgres a writer may also do it in two steps, the first on a session beside its own:
    draw_jobs, then copy_drawn_jobs in its transaction."""
    if not specs:
        return Written([], 0)
    rows = _job_rows(session, run_id, kind, specs, hashes, now)
    ids = insert_rows(session, Job.__table__, rows)
    cached = sum(row["cached"] for row in rows)
    record_first_events(session, run_id, ids, cached=cached, now=now)
    return Written(ids, cached)


@dataclass(frozen=True)
class DrawnJobs:
    """New jobs as write_jobs writes them, made ready to copy in (Postgres), on a session
    that may be beside the writer's: ids drawn (a rollback of the writer's transaction
    leaves them unused), stored outputs looked up, rows formatted as COPY's text."""

    ids: list[int]
    cached: int
    formatted: CopyText


def draw_jobs(
    session: Session,
    run_id: int,
    kind: Kind,
    specs: Sequence[dict[str, Any]],
    hashes: Sequence[str],
    now: datetime,
) -> DrawnJobs:
    """write_jobs' first step, which writes nothing."""
    rows = _job_rows(session, run_id, kind, specs, hashes, now)
    ids, formatted = drawn_rows(session, Job.__table__, rows)
    return DrawnJobs(ids, sum(row["cached"] for row in rows), formatted)


def copy_drawn_jobs(session: Session, run_id: int, jobs: DrawnJobs, now: datetime) -> Written:
    """write_jobs' second step, in the writer's transaction."""
    if jobs.ids:
        copy_in(session, jobs.formatted)
        record_first_events(session, run_id, jobs.ids, cached=jobs.cached, now=now)
    return Written(jobs.ids, jobs.cached)


def _job_rows(
    session: Session,
    run_id: int,
    kind: Kind,
    specs: Sequence[dict[str, Any]],
    hashes: Sequence[str],
    now: datetime,
) -> list[dict[str, Any]]:
    known = stored_outputs(session, hashes)
    return [
        job_row(run_id, kind, spec, spec_hash, known.get(spec_hash), now)
        for spec, spec_hash in zip(specs, hashes, strict=True)
    ]


def add_jobs(session: Session, run: Run, kind: Kind, specs: Sequence[Spec]) -> int:
    """Writes the run's jobs, one per spec, counted in the run; returns how many were done
    as they were written (a run served wholly from the store is closed)."""
    run.job_count += len(specs)  # a job may add jobs to its own run (a dedup's clusters)
    if not specs:
        close_runs(session, [run.id])  # nothing to do (a retry with nothing failed): done
        return 0
    hashes = [spec.hash() for spec in specs]
    written = write_jobs(session, run.id, kind, [s.to_dict() for s in specs], hashes, utcnow())
    record_submitted(session, run.id, cached=written.cached)
    return written.cached


def sendable_ids(sessions: sessionmaker[Session], run_id: int) -> Iterator[int]:
    """The run's jobs that have not finished and that no live worker holds, in id order,
    read a page at a time. Only an empty page ends it, not a short one: a run worked on
    in-process (embedded) meets the jobs its jobs add to it (a train run's next job, a
    dedup's clusters) in the pages after the one that held them."""
    after = 0
    while True:
        with sessions.begin() as session:
            in_index_order(session)  # the run's jobs by ix_jobs_run_id_id, a page at a time
            page = session.scalars(
                select(Job.id)
                .where(
                    Job.run_id == run_id,
                    Job.id > after,
                    Job.status.not_in(FINISHED),
                    or_(Job.status != JobStatus.running, Job.lease_expires_at < utcnow()),
                )
                .order_by(Job.id)
                .limit(PAGE)
            ).all()
        if not page:
            return
        yield from page
        after = page[-1]


def messages(sessions: sessionmaker[Session], run: Run) -> Iterator[list[int]]:
    """The job ids of each message the run's sendable jobs make, in id order."""
    yield from chunked(sendable_ids(sessions, run.id), run.jobs_per_message)


def enqueue(
    sessions: sessionmaker[Session],
    send: Send,
    run_id: int,
    on_sent: Callable[[int], None] = lambda jobs: None,
) -> Sent:
    """Sends every sendable job of the run, a page of messages at a time, marking each page
    the broker took as queued and telling `on_sent` how many jobs it held."""
    with sessions() as session:
        run = session.get_one(Run, run_id)
    kind = kind_named(run.kind)
    jobs = count = 0
    per_page = max(1, PAGE // run.jobs_per_message)
    for page in chunked(messages(sessions, run), per_page):
        try:
            send(kind, page, run.task_options)
        except Exception as error:  # kombu raises several kinds for a broker it cannot reach
            with sessions.begin() as session:
                mark_unsent(session, run_id, page[0][0] - 1, reason=f"not sent: {error}")
            raise EnqueueFailed(run_id, count, error) from error
        with sessions.begin() as session:
            mark_queued(session, run_id, page[0][0], page[-1][-1])
        page_jobs = sum(map(len, page))
        jobs += page_jobs
        count += len(page)
        on_sent(page_jobs)
    return Sent(jobs=jobs, messages=count)
