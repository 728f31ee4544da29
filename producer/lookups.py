"""Read-only questions about runs and jobs of any kind, answered as plain dicts for JSON."""

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

from sdq.models.jobs.lifecycle import as_utc
from sdq.models.tables import FINISHED, Job, JobEvent, JobStatus, ModelRecord, Run
from sdq.producer.errors import NotFound
from sdq.producer.kinds import views_of


def time_text(moment: datetime | None) -> str | None:
    return as_utc(moment).isoformat() if moment else None


# Jobs of a run that are counted in its total but not made yet.
PLANNED = "planned"


def get_run(session: Session, run_id: int) -> Run:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}")
    return run


def status_counts(session: Session, run_id: int) -> Counter[str]:
    rows = session.execute(
        select(Job.status, func.count()).where(Job.run_id == run_id).group_by(Job.status)
    )
    return Counter({str(status): count for status, count in rows})


def run_counts(session: Session, run: Run) -> Counter[str]:
    """The run's jobs by status, adding up to its total: a train run makes each job when
    the one before it ends, and counts the rest as planned."""
    counts = status_counts(session, run.id)
    planned = run.job_count - counts.total()
    if planned > 0:
        counts[PLANNED] = planned
    return counts


def _open(counts: Counter[str]) -> int:
    """The run's jobs made and not finished."""
    return sum(n for status, n in counts.items() if status not in (*FINISHED, PLANNED))


def run_status(session: Session, run_id: int, *, with_jobs: bool = True) -> dict[str, Any]:
    """Where a run stands: its jobs by status, its speed and time left, what failed."""
    run = get_run(session, run_id)
    counts = run_counts(session, run)
    remaining = run.job_count - sum(counts[str(status)] for status in FINISHED)
    done = _work_done(session, run_id)
    # Time left only while something works on the run: a stopped run has none.
    working = counts[JobStatus.running] > 0
    per_second = done.per_second
    status: dict[str, Any] = {
        "run_id": run.id,
        "kind": run.kind,
        "unit": views_of(run.kind).unit,
        "source": run.source,
        "created_at": time_text(run.created_at),
        "total": run.job_count,
        "counts": dict(sorted(counts.items())),
        # Or ended with jobs it will not make: a train run whose job was cancelled or died
        # makes no next one (those wait for `sdq retry`). One made meanwhile (by a worker
        # whose lease ran out) is open: not finished.
        "finished": remaining == 0 or (run.finished_at is not None and not _open(counts)),
        "finished_at": time_text(run.finished_at),
        "succeeded": counts[JobStatus.succeeded],
        "dead": counts[JobStatus.dead],
        "cached": done.cached,
        "per_second": round(per_second, 3) if per_second else None,
        "eta_seconds": (
            round(remaining / per_second, 1) if per_second and remaining and working else None
        ),
        # Summed over the workers: loading what the work needed (models), and the work.
        "setup_seconds": round(done.setup, 3) if done.setup else None,
        "work_seconds": round(done.work, 3) if done.work else None,
        "failures": failures(session, run_id),
    }
    if with_jobs:
        status["jobs"] = run_jobs(session, run)
    return status


@dataclass(frozen=True)
class WorkDone:
    per_second: float | None  # jobs worked on (not served from cache) over their wall time
    cached: int
    setup: float | None
    work: float | None


def _work_done(session: Session, run_id: int) -> WorkDone:
    """One pass over the run's succeeded jobs: throughput counts only work actually done."""
    worked = Job.cached.is_(False)
    first_start, last_finish, finished_work, cached, setup, work = session.execute(
        select(
            func.min(Job.started_at).filter(worked),
            func.max(Job.finished_at).filter(worked),
            func.count().filter(worked),
            func.count().filter(Job.cached.is_(True)),
            func.sum(Job.setup_seconds),
            func.sum(Job.work_seconds),
        ).where(Job.run_id == run_id, Job.status == JobStatus.succeeded)
    ).one()
    per_second = None
    if finished_work and first_start and last_finish and last_finish > first_start:
        per_second = finished_work / (as_utc(last_finish) - as_utc(first_start)).total_seconds()
    return WorkDone(per_second, cached, setup, work)


def failures(session: Session, run_id: int) -> list[dict[str, Any]]:
    """The run's dead and failed jobs grouped by error, most common first, each with a job
    to look at (`sdq show`)."""
    rows = session.execute(
        select(Job.status, Job.error, func.count(), func.min(Job.id))
        .where(Job.run_id == run_id, Job.status.in_([JobStatus.dead, JobStatus.failed]))
        .group_by(Job.status, Job.error)
        .order_by(func.count().desc(), func.min(Job.id))
    )
    return [
        {"status": str(status), "error": error, "jobs": count, "example_job": example}
        for status, error, count, example in rows
    ]


def first_dead(session: Session, run_id: int) -> tuple[int, str | None, int] | None:
    """The run's first dead job, its error and how many are dead; None when none is."""
    dead = Job.run_id == run_id, Job.status == JobStatus.dead
    first = session.execute(
        select(Job.id, Job.error).where(*dead).order_by(Job.id).limit(1)
    ).first()
    if first is None:
        return None
    return first.id, first.error, session.scalar(select(func.count()).where(*dead))


def run_jobs(session: Session, run: Run) -> list[dict[str, Any]]:
    rows = session.execute(
        select(Job.id, Job.status, Job.output_uri).where(Job.run_id == run.id).order_by(Job.id)
    ).all()
    fields = views_of(run.kind).job_fields(session, [job_id for job_id, _, _ in rows])
    return [
        {"id": job_id, "status": str(status), "uri": uri, **fields.get(job_id, {})}
        for job_id, status, uri in rows
    ]


def recent_runs(session: Session, limit: int = 20) -> list[dict[str, Any]]:
    runs = session.scalars(select(Run).order_by(Run.id.desc()).limit(limit)).all()
    return [
        {
            "run_id": run.id,
            "kind": run.kind,
            "created_at": time_text(run.created_at),
            "source": run.source,
            "total": run.job_count,
            "counts": dict(sorted(run_counts(session, run).items())),
            "finished_at": time_text(run.finished_at),
        }
        for run in runs
    ]


# A spec-hash prefix shorter than this would name too many images to be worth a query.
MIN_HASH_PREFIX = 6


def job_named(session: Session, ref: str) -> int:
    """The job a person names: its id, its spec hash or a unique prefix of it, or the path
    or URI of its output (`.../images/<hash>.png`). Of several jobs with one spec, the one
    that made the output."""
    if ref.isdigit():
        return int(ref)
    prefix = PurePosixPath(ref.rstrip("/")).stem.lower() if "/" in ref or "." in ref else ref
    if len(prefix) < MIN_HASH_PREFIX or any(c not in "0123456789abcdef" for c in prefix):
        raise NotFound(
            f"{ref!r} names no job: give a job id, a spec hash (or {MIN_HASH_PREFIX}+ of its "
            "first characters), or an image's path"
        )
    hashes = session.scalars(spec_hashes_starting(prefix, limit=2)).all()
    if not hashes:
        raise NotFound(f"no job with a spec hash starting {prefix}")
    if len(hashes) > 1:
        raise NotFound(f"{prefix} starts more than one spec hash: give more of it")
    return session.scalars(
        select(Job.id)
        .where(Job.spec_hash == hashes[0])
        .order_by((Job.status == JobStatus.succeeded).desc(), Job.cached, Job.id)
        .limit(1)
    ).one()


def spec_hashes_starting(prefix: str, *, limit: int) -> Select[tuple[str]]:
    """Distinct spec hashes that start with `prefix`: on Postgres, a range of their index."""
    return select(Job.spec_hash).where(Job.spec_hash.startswith(prefix)).distinct().limit(limit)


def job_details(session: Session, job_id: int) -> dict[str, Any]:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    events = session.scalars(
        select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.at, JobEvent.id)
    )
    return {
        "id": job.id,
        "run_id": job.run_id,
        "kind": job.kind,
        "status": str(job.status),
        **views_of(job.kind).job_fields(session, [job.id]).get(job.id, {}),
        "cached": job.cached,
        "uri": job.output_uri,
        "spec": job.spec,
        "spec_hash": job.spec_hash,
        "attempts": job.attempts,
        "worker": job.worker_host,
        "device": job.device,
        "created_at": time_text(job.created_at),
        "enqueued_at": time_text(job.enqueued_at),
        "started_at": time_text(job.started_at),
        "finished_at": time_text(job.finished_at),
        "work_seconds": job.work_seconds,
        "error": job.error,
        "sha256": job.output_sha256,
        "events": [
            {
                "at": time_text(event.at),
                "status": str(event.status),
                "worker": event.worker_host,
                "detail": event.detail,
            }
            for event in events
        ],
    }


def known_models(session: Session) -> list[dict[str, Any]]:
    records = session.scalars(select(ModelRecord).order_by(ModelRecord.id.desc()))
    return [
        {
            "name": record.name,
            "format": record.format,
            "revision": record.revision,
            "source": record.source,
            "store_prefix": record.store_prefix,
            "created_at": time_text(record.created_at),
        }
        for record in records
    ]
