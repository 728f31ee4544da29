"""Job status changes. Each one is a conditional UPDATE plus rows in the event history.

The conditions make every transition safe to attempt twice: a duplicated message, a
second worker or a re-sent batch finds nothing to change and does nothing.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, Select, and_, func, insert, literal, select, update
from sqlalchemy.orm import Session

from sdq.models.db import among_digests, chunked, insert_rows
from sdq.models.jobs.notices import note_settled
from sdq.models.settings import JobSettings
from sdq.models.store import existing
from sdq.models.tables import CLAIMABLE, FINISHED, Job, JobEvent, JobStatus, Run

# Jobs that wait for a message to be sent: never sent, or failed and to be sent again.
UNSENT = (JobStatus.pending, JobStatus.failed)
OUTAGE = "an outage: the attempt is not counted"
WAITING = "waiting for its inputs: the attempt is not counted"


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Worker:
    host: str  # hostname:pid, so two workers on one machine are told apart
    device: str


@dataclass(frozen=True)
class Output:
    job_id: int
    uri: str | None  # None: done, with nothing to keep (an image the safety checker flagged)
    sha256: str | None
    work_seconds: float | None
    cached: bool = False
    setup_seconds: float | None = None  # this job's share of loading what the work needed
    units: int | None = None  # images or samples made


def record_events(
    session: Session,
    job_ids: Iterable[int],
    status: JobStatus,
    *,
    worker: Worker | None = None,
    detail: str | None = None,
    at: datetime | None = None,
) -> None:
    at = at or utcnow()
    host = worker.host if worker else None
    job_ids = list(job_ids)
    rows = [
        {"job_id": job_id, "status": status, "worker_host": host, "detail": detail, "at": at}
        for job_id in job_ids
    ]
    insert_rows(session, JobEvent.__table__, rows)
    if status in FINISHED:
        note_settled(session, job_ids)


def record_events_of(
    session: Session,
    jobs: ColumnElement[bool],
    status: JobStatus,
    *,
    detail: str | None = None,
    at: datetime,
) -> None:
    """One history row for each job matching `jobs`, written by the database itself."""
    columns = JobEvent.__table__.c
    session.execute(
        insert(JobEvent).from_select(
            ["job_id", "status", "at", "detail"],
            select(
                Job.id,
                literal(status, columns.status.type),
                literal(at, columns.at.type),
                literal(detail, columns.detail.type),
            ).where(jobs),
        )
    )


def mark_queued(session: Session, run_id: int, first_id: int, last_id: int) -> None:
    """After the broker took the messages for the run's jobs `first_id`..`last_id`: those
    that waited for a send (pending, or failed and sent again) become queued. A submit's
    jobs are committed queued already, so only a re-send moves rows here."""
    now = utcnow()
    waiting = and_(Job.run_id == run_id, Job.id.between(first_id, last_id), Job.status.in_(UNSENT))
    moved = session.scalars(
        update(Job)
        .where(waiting)
        .values(status=JobStatus.queued, enqueued_at=now)
        .returning(Job.id)
    ).all()
    record_events(session, moved, JobStatus.queued, at=now)


def mark_resent(session: Session, job_ids: Sequence[int]) -> None:
    """After the broker took messages for these jobs again: they are queued as of now, so
    the relay waits its full time before it sends them once more."""
    now = utcnow()
    for chunk in chunked(job_ids):
        moved = session.scalars(
            update(Job)
            .where(Job.id.in_(chunk), Job.status.in_(CLAIMABLE))
            .values(status=JobStatus.queued, enqueued_at=now, retry_at=None)
            .returning(Job.id)
        ).all()
        record_events(session, moved, JobStatus.queued, detail="sent again by the relay", at=now)


def mark_unsent(session: Session, run_id: int, after_id: int, reason: str) -> None:
    """The broker failed before it took the run's jobs past `after_id`: those still queued
    go back to pending, so the record says they wait for a send."""
    now = utcnow()
    unsent = and_(Job.run_id == run_id, Job.id > after_id, Job.status == JobStatus.queued)
    moved = session.scalars(
        update(Job).where(unsent).values(status=JobStatus.pending).returning(Job.id)
    ).all()
    record_events(session, moved, JobStatus.pending, detail=reason, at=now)


def as_utc(moment: datetime) -> datetime:
    """SQLite hands timestamps back without a zone; sdq writes them all in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def succeed(session: Session, outputs: Sequence[Output], *, worker: Worker) -> None:
    """Records the outputs of the jobs this worker still holds, and only theirs: a worker
    whose lease lapsed and was taken over must not overwrite the new owner's record (its
    image bytes are identical), nor give a job it no longer holds a success in its history."""
    outputs = _held(session, outputs, worker)
    if not outputs:
        return
    now = utcnow()
    # Bulk UPDATE by primary key, still guarded by the owner.
    session.execute(
        update(Job).where(Job.status == JobStatus.running, Job.worker_host == worker.host),
        [
            {
                "id": output.job_id,
                "status": JobStatus.succeeded,
                "finished_at": now,
                "lease_expires_at": None,
                "output_uri": output.uri,
                "output_sha256": output.sha256,
                "setup_seconds": output.setup_seconds,
                "work_seconds": output.work_seconds,
                "units": output.units,
                "cached": output.cached,
                "error": None,
            }
            for output in outputs
        ],
        execution_options={"synchronize_session": None},
    )
    finished = [output.job_id for output in outputs]
    record_events(session, finished, JobStatus.succeeded, worker=worker, at=now)
    close_finished_runs(session, finished)


def _held(session: Session, outputs: Sequence[Output], worker: Worker) -> list[Output]:
    """The outputs of jobs the worker holds, those jobs locked until the transaction ends
    (Postgres; SQLite has one writer)."""
    held = session.scalars(
        select(Job.id)
        .where(
            Job.id.in_([output.job_id for output in outputs]),
            Job.status == JobStatus.running,
            Job.worker_host == worker.host,
        )
        .order_by(Job.id)
        .with_for_update()
    ).all()
    return [output for output in outputs if output.job_id in set(held)]


def fail(
    session: Session,
    job_ids: Sequence[int],
    *,
    error: str,
    permanent: bool,
    outage: bool = False,
    waiting: bool = False,
    settings: JobSettings,
    worker: Worker,
) -> list[int]:
    """Records a failure; returns the jobs that may be tried again, each due to be sent
    again now (`retry_due` says when its retry's countdown ends). An outage gives the
    attempt back while the job's first failure is less than the outage budget ago; waiting
    for inputs that other jobs make gives it back always."""
    now = utcnow()
    jobs = session.scalars(
        select(Job).where(
            Job.id.in_(job_ids), Job.status == JobStatus.running, Job.worker_host == worker.host
        )
    ).all()
    forgiven = _forgiven(session, jobs, settings, now, outage=outage, waiting=waiting)
    for job in jobs:
        if job.id in forgiven:
            job.attempts -= 1
        dead = permanent or job.attempts >= settings.max_attempts
        job.status = JobStatus.dead if dead else JobStatus.failed
        job.error = error
        job.lease_expires_at = None
        job.finished_at = now if dead else None
        job.retry_at = None if dead else now
    retryable = [job.id for job in jobs if job.status == JobStatus.failed]
    given_up = [job.id for job in jobs if job.status == JobStatus.dead]
    detail = f"{error} ({WAITING if waiting else OUTAGE})" if forgiven else error
    record_events(session, retryable, JobStatus.failed, worker=worker, detail=detail, at=now)
    record_events(session, given_up, JobStatus.dead, worker=worker, detail=error, at=now)
    close_finished_runs(session, given_up)
    return retryable


def retry_due(session: Session, job_ids: Sequence[int], at: datetime) -> None:
    """When the retry of these failed jobs is due in a queue (its countdown's end): until
    then the relay leaves them to their message (models/jobs/maintenance.py)."""
    session.execute(
        update(Job).where(Job.id.in_(job_ids), Job.status == JobStatus.failed).values(retry_at=at)
    )


def _forgiven(
    session: Session,
    jobs: Sequence[Job],
    settings: JobSettings,
    now: datetime,
    *,
    outage: bool,
    waiting: bool,
) -> set[int]:
    """The jobs whose attempt is given back: every one waiting for its inputs, those in an
    outage within its budget."""
    if waiting:
        return {job.id for job in jobs}
    return _within_outage_budget(session, jobs, settings, now) if outage else set()


def _within_outage_budget(
    session: Session, jobs: Sequence[Job], settings: JobSettings, now: datetime
) -> set[int]:
    """The jobs whose first failure (this one, if none came before) is within the budget."""
    first_failed = dict(
        session.execute(
            select(JobEvent.job_id, func.min(JobEvent.at))
            .where(
                JobEvent.job_id.in_([job.id for job in jobs]),
                JobEvent.status == JobStatus.failed,
            )
            .group_by(JobEvent.job_id)
        ).all()
    )
    budget = timedelta(seconds=settings.outage_budget_seconds)
    return {job.id for job in jobs if now - as_utc(first_failed.get(job.id, now)) < budget}


def retry_jobs(
    session: Session, run_id: int, statuses: Iterable[JobStatus], *, asked_by: str
) -> list[int]:
    """Gives the run's jobs in these finished-or-failed states a fresh start (no attempts
    used, no error) as `pending`, to be sent again, and opens the run again."""
    now = utcnow()
    again = session.scalars(
        update(Job)
        .where(Job.run_id == run_id, Job.status.in_(list(statuses)))
        .values(
            status=JobStatus.pending,
            attempts=0,
            error=None,
            finished_at=None,
            lease_expires_at=None,
            cached=False,
        )
        .returning(Job.id)
    ).all()
    detail = f"retry asked by {asked_by}"
    record_events(session, again, JobStatus.pending, detail=detail, at=now)
    if again:
        session.execute(update(Run).where(Run.id == run_id).values(finished_at=None))
    return sorted(again)


def release_jobs(session: Session, run_id: int, *, worker: Worker, reason: str) -> list[int]:
    """Puts back the run's jobs this worker holds, at once and without using up an attempt:
    it stopped on purpose (Ctrl-C), so no lease needs to run out first."""
    return _put_back(session, Job.run_id == run_id, worker=worker, reason=reason)


def put_back_jobs(
    session: Session, job_ids: Sequence[int], *, worker: Worker, reason: str
) -> list[int]:
    """Puts back these jobs this worker holds, as `release_jobs` does: its work left them
    for later (it gave way to work someone waits for)."""
    return _put_back(session, Job.id.in_(job_ids), worker=worker, reason=reason) if job_ids else []


def _put_back(session: Session, which, *, worker: Worker, reason: str) -> list[int]:
    released = session.scalars(
        update(Job)
        .where(which, Job.status == JobStatus.running, Job.worker_host == worker.host)
        .values(status=JobStatus.queued, lease_expires_at=None, attempts=Job.attempts - 1)
        .returning(Job.id)
    ).all()
    record_events(session, released, JobStatus.queued, worker=worker, detail=reason)
    return sorted(released)


def close_finished_runs(session: Session, job_ids: Sequence[int]) -> None:
    """Stamps `finished_at` on the runs of these jobs that have no unfinished job left."""
    if job_ids:
        close_runs(session, select(Job.run_id).where(Job.id.in_(job_ids)))


def close_runs(session: Session, run_ids: Select[tuple[int]] | Sequence[int]) -> None:
    """Stamps `finished_at` on those of the runs that have no unfinished job left. The runs
    are locked first (Postgres; SQLite has one writer): two workers recording a run's last
    two jobs at once would each see the other's still running, and leave the run open for
    the beat's sweep. Locked, the second looks once the first has committed. The lock is
    the one the stamp takes anyway (FOR NO KEY UPDATE): new jobs of the run still go in."""
    locked = select(Run.id).where(Run.id.in_(run_ids)).order_by(Run.id)
    session.execute(locked.with_for_update(key_share=True))
    open_jobs = select(Job.id).where(Job.run_id == Run.id, Job.status.not_in(FINISHED)).exists()
    session.execute(
        update(Run)
        .where(Run.id.in_(run_ids), Run.finished_at.is_(None), ~open_jobs)
        .values(finished_at=utcnow())
    )


def stored_outputs(session: Session, spec_hashes: Iterable[str]) -> dict[str, tuple[str, str]]:
    """spec hash -> (uri, sha256) of an output some job already made for it and that is
    still in the store: the database says what was made, the store whether it is still
    there (a store restarted empty, a lifecycle rule, a cleanup by hand)."""
    found: dict[str, tuple[str, str]] = {}
    for chunk in chunked(sorted(set(spec_hashes))):
        rows = session.execute(
            select(Job.spec_hash, Job.output_uri, Job.output_sha256).where(
                among_digests(session, Job.spec_hash, chunk),
                Job.status == JobStatus.succeeded,
                Job.output_uri.is_not(None),
            )
        )
        for spec_hash, uri, digest in rows:
            found[spec_hash] = (uri, digest)
    there = existing(uri for uri, _ in found.values())
    return {spec_hash: output for spec_hash, output in found.items() if output[0] in there}
