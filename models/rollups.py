"""Hourly rollups for dashboards: per hour, kind, model and worker, the jobs that succeeded,
what they made, where their time went and how often jobs failed. Beat recomputes the
recent hours; Grafana (ops/grafana/) and SQL read the table instead of scanning jobs.

A job's model is the one its spec names (`model_name`: what a render or an encode uses,
what a train run's checkpoints are registered as); a kind without one rolls up under ''.
"""

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, delete, func, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.lifecycle import as_utc
from sdq.models.jobs.maintenance import Lock, holds_lock
from sdq.models.tables import HourlyRollup, Job, JobEvent, JobStatus

# By the first four columns, the key (hour, kind, model, worker): by position, since each
# rendering of a COALESCE binds its '' anew and Postgres cannot tell two of them equal.
BY_KEY = text("1, 2, 3, 4")
# A job's model in the key: its spec's, or '' for the kinds without one.
MODEL = func.coalesce(Job.spec["model_name"].as_string(), "")


def roll_up(sessions: sessionmaker[Session]) -> int:
    """Recomputes the hourly rollups from the hour before the latest one kept (all of the
    history the first time) up to now; returns how many rows it wrote. Recomputing, not
    adding, keeps it right when it runs twice or a late job lands in a past hour."""
    with sessions.begin() as session:
        if not holds_lock(session, Lock.rollup):
            return 0
        latest = session.scalar(select(func.max(HourlyRollup.hour)))
        since = as_utc(latest) - timedelta(hours=1) if latest else None
        rows = _hourly(session, since)
        if since is not None:
            session.execute(delete(HourlyRollup).where(HourlyRollup.hour >= since))
        else:
            session.execute(delete(HourlyRollup))
        if rows:
            session.execute(insert(HourlyRollup), rows)
        return len(rows)


def _hourly(session: Session, since: datetime | None) -> list[dict[str, Any]]:
    """Per hour, kind, model and worker: the jobs that succeeded in it, and the failures."""
    rows: dict[tuple[datetime, str, str, str], dict[str, Any]] = {}
    done = successes_by_hour(session, since)
    for hour, kind, model_name, worker, jobs, cached, units, setup, work in session.execute(done):
        key = (_as_hour(hour), kind, model_name, worker)
        rows[key] = _rollup(key, jobs=jobs, cached=cached, units=units, setup=setup, work=work)
    for hour, kind, model_name, worker, count in session.execute(failures_by_hour(session, since)):
        key = (_as_hour(hour), kind, model_name, worker)
        rows.setdefault(key, _rollup(key))["failures"] = count
    return list(rows.values())


def successes_by_hour(session: Session, since: datetime | None) -> Select[Any]:
    """Jobs that succeeded per hour, kind, model and worker since `since`, with what they
    made and where their time went: on Postgres a range of the finished jobs' index."""
    done = (
        select(
            _hour(session, Job.finished_at),
            Job.kind,
            MODEL,
            func.coalesce(Job.worker_host, ""),
            func.count(),
            func.count().filter(Job.cached.is_(True)),
            func.coalesce(func.sum(Job.units), 0),
            func.coalesce(func.sum(Job.setup_seconds), 0.0),
            func.coalesce(func.sum(Job.work_seconds), 0.0),
        )
        .where(Job.status == JobStatus.succeeded, Job.finished_at.is_not(None))
        .group_by(BY_KEY)
    )
    return done if since is None else done.where(Job.finished_at >= since)


def failures_by_hour(session: Session, since: datetime | None) -> Select[Any]:
    """Failures (retried or given up) per hour, kind, model and worker since `since`: on
    Postgres a range of the setbacks' index, not a scan of every event."""
    failures = (
        select(
            _hour(session, JobEvent.at),
            Job.kind,
            MODEL,
            func.coalesce(JobEvent.worker_host, ""),
            func.count(),
        )
        .join(Job, Job.id == JobEvent.job_id)
        .where(JobEvent.status.in_([JobStatus.failed, JobStatus.dead]))
        .group_by(BY_KEY)
    )
    return failures if since is None else failures.where(JobEvent.at >= since)


def _rollup(
    key: tuple[datetime, str, str, str],
    *,
    jobs: int = 0,
    cached: int = 0,
    units: int = 0,
    setup: float = 0.0,
    work: float = 0.0,
) -> dict[str, Any]:
    hour, kind, model, worker = key
    return {
        "hour": hour,
        "kind": kind,
        "model": model,
        "worker": worker,
        "jobs": jobs,
        "cached": cached,
        "units": units,
        "setup_seconds": setup,
        "work_seconds": work,
        "failures": 0,
    }


def _hour(session: Session, moment: Any) -> Any:
    """The hour a timestamp falls in, in the backend's words."""
    if session.get_bind().dialect.name == "postgresql":
        # In UTC, not the session's time zone, whose hours may start at half past.
        return func.date_trunc("hour", func.timezone("UTC", moment))
    return func.strftime("%Y-%m-%d %H:00:00", moment)


def _as_hour(value: datetime | str) -> datetime:
    # SQLite's strftime gives text; Postgres a timestamp. sdq writes every time in UTC.
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    return as_utc(moment)
