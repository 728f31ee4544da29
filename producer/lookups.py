"""Read-only questions about runs and jobs, answered as plain dicts ready for JSON."""

from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.lifecycle import as_utc
from models.specs import image_key
from models.tables import FINISHED, Job, JobEvent, JobStatus, ModelRecord, Run


class NotFound(Exception):
    pass


def _time(moment: datetime | None) -> str | None:
    return as_utc(moment).isoformat() if moment else None


def status_counts(session: Session, run_id: int) -> Counter[str]:
    rows = session.execute(
        select(Job.status, func.count()).where(Job.run_id == run_id).group_by(Job.status)
    )
    return Counter({str(status): count for status, count in rows})


def run_status(session: Session, run_id: int, *, with_jobs: bool = True) -> dict[str, Any]:
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id}")
    counts = status_counts(session, run_id)
    done = sum(counts[str(status)] for status in FINISHED)
    # One pass over the run's succeeded jobs: throughput counts only what was rendered.
    rendered_only = Job.cached.is_(False)
    first_start, last_finish, rendered, cached = session.execute(
        select(
            func.min(Job.started_at).filter(rendered_only),
            func.max(Job.finished_at).filter(rendered_only),
            func.count().filter(rendered_only),
            func.count().filter(Job.cached.is_(True)),
        ).where(Job.run_id == run_id, Job.status == JobStatus.succeeded)
    ).one()
    throughput = None
    if rendered and first_start and last_finish and last_finish > first_start:
        throughput = rendered / (as_utc(last_finish) - as_utc(first_start)).total_seconds()
    remaining = run.job_count - done
    status: dict[str, Any] = {
        "run_id": run.id,
        "source": run.source,
        "created_at": _time(run.created_at),
        "total": run.job_count,
        "counts": dict(sorted(counts.items())),
        "finished": remaining == 0,
        "finished_at": _time(run.finished_at),
        "succeeded": counts[JobStatus.succeeded],
        "dead": counts[JobStatus.dead],
        "cached": cached,
        "images_per_second": round(throughput, 3) if throughput else None,
        "eta_seconds": round(remaining / throughput, 1) if throughput and remaining else None,
    }
    if with_jobs:
        rows = session.execute(
            select(Job.id, Job.status, Job.output_uri, Job.prompt, Job.seed)
            .where(Job.run_id == run_id)
            .order_by(Job.id)
        )
        status["jobs"] = [
            {"id": job_id, "status": str(job_status), "uri": uri, "prompt": prompt, "seed": seed}
            for job_id, job_status, uri, prompt, seed in rows
        ]
    return status


def recent_runs(session: Session, limit: int = 20) -> list[dict[str, Any]]:
    runs = session.scalars(select(Run).order_by(Run.id.desc()).limit(limit)).all()
    return [
        {
            "run_id": run.id,
            "created_at": _time(run.created_at),
            "source": run.source,
            "total": run.job_count,
            "counts": dict(sorted(status_counts(session, run.id).items())),
            "finished_at": _time(run.finished_at),
        }
        for run in runs
    ]


def job_details(session: Session, job_id: int) -> dict[str, Any]:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    events = session.scalars(
        select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.at, JobEvent.id)
    )
    return {
        **job_summary(job),
        "spec": job.spec,
        "spec_hash": job.spec_hash,
        "source_line": job.source_line,
        "attempts": job.attempts,
        "worker": job.worker_host,
        "device": job.device,
        "created_at": _time(job.created_at),
        "enqueued_at": _time(job.enqueued_at),
        "started_at": _time(job.started_at),
        "finished_at": _time(job.finished_at),
        "render_seconds": job.render_seconds,
        "error": job.error,
        "sha256": job.output_sha256,
        "events": [
            {
                "at": _time(event.at),
                "status": str(event.status),
                "worker": event.worker_host,
                "detail": event.detail,
            }
            for event in events
        ],
    }


def job_summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "run_id": job.run_id,
        "status": str(job.status),
        "prompt": job.prompt,
        "style": job.style,
        "model": job.model,
        "seed": job.seed,
        "cached": job.cached,
        "uri": job.output_uri,
    }


def find_jobs(
    session: Session,
    *,
    prompt: str | None = None,
    style: str | None = None,
    model: str | None = None,
    run_id: int | None = None,
    status: str | None = None,
    limit: int = 50,
) -> list[dict[str, Any]]:
    """Substring matches, case-insensitive; the trigram index serves them on Postgres."""
    query = select(Job).order_by(Job.id.desc()).limit(limit)
    if prompt:
        query = query.where(Job.prompt.ilike(f"%{_escape_like(prompt)}%", escape="\\"))
    if style:
        query = query.where(Job.style.ilike(f"%{_escape_like(style)}%", escape="\\"))
    if model:
        query = query.where(Job.model == model)
    if run_id is not None:
        query = query.where(Job.run_id == run_id)
    if status:
        query = query.where(Job.status == JobStatus(status))
    return [job_summary(job) for job in session.scalars(query)]


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def job_image_key(session: Session, job_id: int) -> str:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"no job {job_id}")
    if job.status != JobStatus.succeeded:
        raise NotFound(f"job {job_id} has no image: it is {job.status}")
    return image_key(job.spec_hash)


def known_models(session: Session) -> list[dict[str, Any]]:
    records = session.scalars(select(ModelRecord).order_by(ModelRecord.id.desc()))
    return [
        {
            "name": record.name,
            "revision": record.revision,
            "source": record.source,
            "store_prefix": record.store_prefix,
            "created_at": _time(record.created_at),
        }
        for record in records
    ]


def gallery_jobs(session: Session, run_id: int) -> list[dict[str, Any]]:
    if session.get(Run, run_id) is None:
        raise NotFound(f"no run {run_id}")
    rows = session.execute(
        select(Job.source_line, Job.style, Job.prompt, Job.seed, Job.status, Job.spec_hash)
        .where(Job.run_id == run_id)
        .order_by(Job.id)
    )
    return [
        {"source_line": line, "style": style, "prompt": prompt, "seed": seed,
         "status": str(status), "spec_hash": spec_hash}
        for line, style, prompt, seed, status, spec_hash in rows
    ]  # fmt: skip
