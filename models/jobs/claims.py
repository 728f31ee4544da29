"""Taking jobs: a claim takes each job once, whoever else tries; a lease says its worker
still holds it, and one that runs out lets another worker take it over (or buries a job
that used every attempt); a job whose twin (same spec) is being made waits for its output
instead of making it again. Every time is the database's clock."""

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Select, and_, func, or_, select, update
from sqlalchemy.orm import Session, aliased

from sdq.models.jobs.lifecycle import Worker, as_utc, close_finished_runs, record_events, utcnow
from sdq.models.tables import CLAIMABLE, Job, JobStatus

# A job whose twin (same spec) is being made looks again this soon, to be served its output.
TWIN_RECHECK_SECONDS = 3


LOST = "attempts exhausted: the worker holding the job stopped renewing its lease"


def database_now(session: Session) -> datetime:
    """The database's clock, which leases are set and judged by: no worker's own clock
    matters (one five minutes behind set leases that others found run out at once, and
    did its jobs again). Embedded, on SQLite, every worker shares one machine's clock."""
    if session.get_bind().dialect.name == "postgresql":
        # The clock now, not the transaction's start (now()): a claim may have waited on
        # its specs' locks.
        return session.scalar(select(func.clock_timestamp()))
    return utcnow()


def abandoned_at(now: datetime) -> ColumnElement[bool]:
    """Running, but the worker holding it has stopped renewing its lease: it died, or
    lost its way to the database."""
    return and_(Job.status == JobStatus.running, Job.lease_expires_at < now)


def cancel_jobs(session: Session, run_id: int) -> list[int]:
    """Cancels the run's jobs that no worker holds: not started, or running on a lease that
    ran out (a killed embedded run's, whose job no beat takes back); a worker that gets one
    finds nothing, and one that comes back to its lapsed job finds it taken."""
    now = database_now(session)
    cancelled = session.scalars(
        update(Job)
        .where(Job.run_id == run_id, or_(Job.status.in_(CLAIMABLE), abandoned_at(now)))
        .values(status=JobStatus.cancelled, finished_at=now, lease_expires_at=None)
        .returning(Job.id)
    ).all()
    record_events(session, cancelled, JobStatus.cancelled, detail="cancelled by the user", at=now)
    close_finished_runs(session, cancelled)
    return sorted(cancelled)  # RETURNING gives no order


def leases_held(session: Session, run_id: int) -> tuple[int, datetime | None]:
    """How many of the run's jobs run on a lease not yet run out, and when the last of those
    leases does: cancel takes a job whose worker is gone once its lease has."""
    count, until = session.execute(
        select(func.count(), func.max(Job.lease_expires_at)).where(
            Job.run_id == run_id,
            Job.status == JobStatus.running,
            Job.lease_expires_at >= database_now(session),
        )
    ).one()
    return count, until


def bury_exhausted(
    session: Session,
    jobs: ColumnElement[bool],
    *,
    max_attempts: int,
    worker: Worker | None,
    at: datetime,
) -> list[int]:
    """Those of `jobs` that were abandoned having used every attempt end dead: a job
    that kills every worker that tries it is not tried for ever."""
    exhausted = session.scalars(
        update(Job)
        .where(jobs, abandoned_at(at), Job.attempts >= max_attempts)
        .values(status=JobStatus.dead, finished_at=at, lease_expires_at=None, error=LOST)
        .returning(Job.id)
    ).all()
    record_events(session, exhausted, JobStatus.dead, worker=worker, detail=LOST, at=at)
    close_finished_runs(session, exhausted)
    return list(exhausted)


def claim(
    session: Session,
    job_ids: Sequence[int],
    *,
    kind: str,
    worker: Worker,
    lease_seconds: int,
    max_attempts: int,
) -> list[Job]:
    """Takes the jobs of this kind that nobody holds; returns only those this worker now
    owns. A job of another kind is never touched: it is not this worker's work.

    A job whose worker died holding it is taken over once its lease runs out, unless it
    has used all its attempts: a job that kills every worker that tries it ends dead.
    """
    _lock_specs(session, job_ids)
    now = database_now(session)
    abandoned = abandoned_at(now)
    mine = Job.id.in_(job_ids) & (Job.kind == kind)
    bury_exhausted(session, mine, max_attempts=max_attempts, worker=worker, at=now)
    claimable = or_(Job.status.in_(CLAIMABLE), abandoned) & ~_twin_running(now).exists()
    lapsed = _lapsed_holders(session, mine & abandoned)
    claimed = session.scalars(
        update(Job)
        .where(mine, claimable)
        .values(
            status=JobStatus.running,
            attempts=Job.attempts + 1,
            worker_host=worker.host,
            device=worker.device,
            started_at=now,
            lease_expires_at=now + timedelta(seconds=lease_seconds),
        )
        .returning(Job),
        execution_options={"synchronize_session": False},
    ).all()
    _record_claimed(session, claimed, lapsed, worker=worker, at=now)
    return sorted(claimed, key=lambda job: job.id)


def _lapsed_holders(session: Session, lapsed: ColumnElement[bool]) -> dict[int, str]:
    """Job id -> the worker whose lease on it ran out, the rows locked: for the history,
    where a second "running" says why it came."""
    query = select(Job.id, Job.worker_host).where(lapsed).with_for_update()
    return dict(session.execute(query).all())


def _record_claimed(
    session: Session,
    claimed: Sequence[Job],
    lapsed: dict[int, str],
    *,
    worker: Worker,
    at: datetime,
) -> None:
    """The history's "running" events: one insert for the fresh jobs, one for each worker
    whose jobs were taken over as their lease ran out (`lapsed`: job id -> its holder)."""
    for holder in {lapsed.get(job.id) for job in claimed}:
        ids = [job.id for job in claimed if lapsed.get(job.id) == holder]
        taken = None if holder is None else f"taken over: the lease of {holder} ran out"
        record_events(session, ids, JobStatus.running, worker=worker, detail=taken, at=at)


def extend_leases(
    session: Session, job_ids: Sequence[int], *, worker: Worker, lease_seconds: int
) -> None:
    session.execute(
        update(Job)
        .where(Job.id.in_(job_ids), Job.status == JobStatus.running, Job.worker_host == worker.host)
        .values(lease_expires_at=database_now(session) + timedelta(seconds=lease_seconds))
    )


def _twin_running(now: datetime) -> Select[tuple[int]]:
    """Another job with the same spec that a live worker is making now: its output will
    serve this one, so this one is not made a second time."""
    twin = aliased(Job)
    return select(twin.id).where(
        twin.spec_hash == Job.spec_hash,
        twin.id != Job.id,
        twin.status == JobStatus.running,
        twin.lease_expires_at >= now,
    )


def _lock_specs(session: Session, job_ids: Sequence[int]) -> None:
    """Claims of jobs with equal specs take turns (Postgres; SQLite has one writer at a
    time anyway), so that two workers cannot both see no twin running and both make it.
    Locks are taken in spec order: two claims never wait on each other in a circle."""
    if session.get_bind().dialect.name != "postgresql":
        return
    specs = select(Job.spec_hash).where(Job.id.in_(job_ids)).distinct().subquery()
    key = func.hashtextextended(specs.c.spec_hash, 0)
    # Postgres takes a volatile function of the select list after the ORDER BY's sort.
    session.execute(
        select(func.pg_advisory_xact_lock(key)).select_from(specs).order_by(specs.c.spec_hash)
    )


def held_until(session: Session, job_ids: Sequence[int]) -> datetime | None:
    """When to look at these unclaimed jobs again: soon, if one is still to be made; else
    when the last lease another worker holds on them runs out; None if nothing holds them
    (each is done, dead or cancelled).

    A job still to be made that the claim passed by had a twin being made then. The twin's
    output will serve it, or the twin has ended since the claim's statement (each statement
    sees what was committed before it began), and the job is claimable again: asking here
    whether a twin is running would find none, and leave the job queued with no message."""
    now = database_now(session)
    if session.scalar(select(Job.id).where(Job.id.in_(job_ids), Job.status.in_(CLAIMABLE))):
        return now + timedelta(seconds=TWIN_RECHECK_SECONDS)
    until = session.scalar(
        select(Job.lease_expires_at)
        .where(Job.id.in_(job_ids), Job.status == JobStatus.running)
        .order_by(Job.lease_expires_at.desc())
        .limit(1)
    )
    return as_utc(until) if until else None
