"""What beat does every few seconds so that nothing waits for someone to type `sdq requeue`:
expire dead leases, send again what the broker lost, close finished runs. (Less often, it
also keeps the hourly rollups: models/rollups.py.)

Each step is one transaction that first takes a Postgres advisory lock of its own and does
nothing when another beat or maintenance worker holds it, so two of them never act twice.
Each is also safe to run twice in a row: it only acts on rows still in the state it looks
for, and a job sent twice is claimed once.
"""

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import IntEnum
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select, true, update
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import chunked, upsert
from sdq.models.jobs.claims import abandoned_at, bury_exhausted, database_now
from sdq.models.jobs.kinds import KINDS, kind_named
from sdq.models.jobs.lifecycle import as_utc, close_runs, mark_resent, record_events, utcnow
from sdq.models.jobs.outbox import Send
from sdq.models.settings import JobSettings
from sdq.models.tables import Job, JobStatus, MaintenanceTick, Run

# Jobs sent again per tick at most: a tick stays short whatever the backlog; the next one
# takes the rest.
RELAY_LIMIT = 10_000
EXPIRED = "lease expired: the worker holding the job stopped renewing it; sent again"


class Lock(IntEnum):
    """Advisory lock keys, one per maintenance step."""

    sweep = 0x5D0_0001
    relay = 0x5D0_0002
    finish = 0x5D0_0003
    rollup = 0x5D0_0004  # models/rollups.py


@dataclass(frozen=True)
class Relayed:
    jobs: int
    messages: int


def record_tick(sessions: sessionmaker[Session], task: str, result: dict[str, Any]) -> None:
    """Notes that a periodic task ran, and what it did: how `sdq health` knows beat is alive."""
    now = utcnow()
    with sessions.begin() as session:
        statement = upsert(session, MaintenanceTick.__table__).values(
            task=task, at=now, result=result
        )
        session.execute(
            statement.on_conflict_do_update(
                index_elements=["task"], set_={"at": now, "result": result}
            )
        )


def last_tick(sessions: sessionmaker[Session], task: str) -> datetime | None:
    """When the periodic task last ran to its end, or None if it never has."""
    with sessions() as session:
        at = session.scalar(select(MaintenanceTick.at).where(MaintenanceTick.task == task))
    return as_utc(at) if at else None


def holds_lock(session: Session, lock: Lock) -> bool:
    """Takes the step's lock for this transaction, if nobody else has it. SQLite (one
    machine, one writer at a time) has no advisory locks and needs none."""
    if session.get_bind().dialect.name != "postgresql":
        return True
    return bool(session.scalar(select(func.pg_try_advisory_xact_lock(int(lock)))))


def sweep_leases(sessions: sessionmaker[Session], settings: JobSettings) -> tuple[int, int]:
    """Running jobs whose lease ran out: back to pending (the relay sends them at once),
    their attempt counted at the claim, or dead once they have used every attempt.
    Returns (sent back, dead)."""
    with sessions.begin() as session:
        if not holds_lock(session, Lock.sweep):
            return 0, 0
        now = database_now(session)
        dead = bury_exhausted(
            session, true(), max_attempts=settings.max_attempts, worker=None, at=now
        )
        back = session.scalars(
            update(Job)
            .where(abandoned_at(now), Job.attempts < settings.max_attempts)
            .values(status=JobStatus.pending, lease_expires_at=None)
            .returning(Job.id)
        ).all()
        record_events(session, back, JobStatus.pending, detail=EXPIRED, at=now)
        return len(back), len(dead)


def relay(
    sessions: sessionmaker[Session],
    send: Send,
    *,
    relay_after: timedelta,
    idle_queues: Collection[str],
) -> Relayed:
    """Sends again the jobs no message carries any more: pending ones (the broker was down
    when they were sent, or their lease expired) at once; queued ones that no worker
    claimed within `relay_after` while their queue lies empty in the broker (it lost the
    message: restarted empty, or flushed); and failed ones whose retry was due that long
    ago (its message lost, or sent to a warm queue that its worker no longer consumes). A
    queue with messages in it is left to drain."""
    with sessions.begin() as session:
        if not holds_lock(session, Lock.relay):
            return Relayed(0, 0)
        by_run = _lost_jobs(session, _lost(relay_after, idle_queues))
        messages = 0
        for run_id, job_ids in by_run.items():
            run = session.get_one(Run, run_id)
            kind = kind_named(run.kind)
            page = list(chunked(job_ids, run.jobs_per_message))
            send(kind, page, run.task_options)
            messages += len(page)
        # Marked after the sends, in the lock's transaction: a send that fails leaves the
        # jobs as they were for the next tick.
        mark_resent(session, [job_id for ids in by_run.values() for job_id in ids])
        return Relayed(sum(map(len, by_run.values())), messages)


def _lost(relay_after: timedelta, idle_queues: Collection[str]) -> ColumnElement[bool]:
    idle_kinds = [kind.name for kind in KINDS.values() if kind.queue in idle_queues]
    overdue = utcnow() - relay_after
    unclaimed = or_(
        and_(Job.status == JobStatus.queued, Job.enqueued_at < overdue),
        and_(Job.status == JobStatus.failed, Job.retry_at < overdue),
    )
    return or_(Job.status == JobStatus.pending, and_(Job.kind.in_(idle_kinds), unclaimed))


def _lost_jobs(session: Session, lost: ColumnElement[bool]) -> dict[int, list[int]]:
    """run id -> its lost job ids, in id order; RELAY_LIMIT of them at most."""
    by_run: dict[int, list[int]] = defaultdict(list)
    rows = session.execute(
        select(Job.run_id, Job.id)
        .join(Run, Run.id == Job.run_id)
        .where(lost, Run.finished_at.is_(None))
        .order_by(Job.id)
        .limit(RELAY_LIMIT)
    )
    for run_id, job_id in rows:
        by_run[run_id].append(job_id)
    return by_run


def runs_finished_since(sessions: sessionmaker[Session], since: datetime) -> list[tuple[str, int]]:
    """The kind and id of every run that finished since `since`."""
    with sessions() as session:
        finished = select(Run.kind, Run.id).where(Run.finished_at >= since).order_by(Run.id)
        return [(kind, run_id) for kind, run_id in session.execute(finished)]


def finish_runs(sessions: sessionmaker[Session]) -> int:
    """Stamps every open run whose jobs have all finished (one whose last job was settled
    by a path that did not close it, or by hand in SQL); returns how many."""
    with sessions.begin() as session:
        if not holds_lock(session, Lock.finish):
            return 0
        open_runs = select(Run.id).where(Run.finished_at.is_(None))
        before = session.scalar(select(func.count()).select_from(open_runs.subquery()))
        close_runs(session, open_runs)
        after = session.scalar(select(func.count()).select_from(open_runs.subquery()))
        return before - after
