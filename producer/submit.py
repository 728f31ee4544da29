"""Submitting: the run and all its jobs in one transaction, then the messages (outbox).

If the broker is down or the process dies after the commit, the jobs are in Postgres as
`pending` and `sdq requeue RUN` (or the periodic relay) sends them; nothing is lost.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models.db import insert_rows
from models.lifecycle import (
    IN_LIST_LIMIT,
    as_utc,
    close_finished_runs,
    mark_queued,
    record_events,
    rendered_outputs,
    utcnow,
)
from models.registry import record_model
from models.specs import ModelIdentity, batches
from models.tables import FINISHED, Job, JobStatus, Run
from producer.plan import PlannedJob
from workers.app import GENERATE_TASK


class EnqueueFailed(Exception):
    def __init__(self, run_id: int, sent: int, total: int, cause: Exception) -> None:
        super().__init__(
            f"run {run_id}: the broker took {sent} of {total} tasks ({cause}); the rest are "
            f"saved as pending: `sdq requeue {run_id}` sends them when the broker is back"
        )


@dataclass(frozen=True)
class Batching:
    batch_size: int  # images per pipeline call
    calls_per_task: int  # pipeline calls per task message

    def tasks(self, jobs: list[tuple[int, str]]) -> list[list[int]]:
        return batches(jobs, self.batch_size * self.calls_per_task)


@dataclass(frozen=True)
class Submission:
    run_id: int
    jobs: int
    cached: int
    tasks: list[list[int]]
    batching: Batching


def record_run(
    sessions: sessionmaker[Session],
    planned: Sequence[PlannedJob],
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
        run = Run(kind="generate", source=source, options=options, job_count=len(planned))
        session.add(run)
        session.flush()
        hashes = [job.spec.hash() for job in planned]
        known = rendered_outputs(session, hashes)
        rows = [
            _job_row(run.id, job, spec_hash, known.get(spec_hash), now)
            for job, spec_hash in zip(planned, hashes, strict=True)
        ]
        ids = insert_rows(session, Job.__table__, rows)
        record_events(session, ids, JobStatus.pending, at=now)
        cached = [job_id for job_id, row in zip(ids, rows, strict=True) if row["cached"]]
        record_events(
            session, cached, JobStatus.succeeded, detail="cached: spec rendered before", at=now
        )
        close_finished_runs(session, cached)
        todo = [
            (job_id, row["batch_key"])
            for job_id, row in zip(ids, rows, strict=True)
            if not row["cached"]
        ]
    return Submission(run.id, len(ids), len(cached), batching.tasks(todo), batching)


def _job_row(
    run_id: int, job: PlannedJob, spec_hash: str, known: tuple[str, str] | None, now: datetime
) -> dict[str, Any]:
    spec = job.spec
    row = {
        "run_id": run_id,
        "kind": "generate",
        "spec": spec.to_dict(),
        "spec_hash": spec_hash,
        "prompt": spec.prompt,
        "style": job.style,
        "model": spec.model_name,
        "seed": spec.seed,
        "source_line": job.source_line,
        "batch_key": spec.batch_key(),
        "status": JobStatus.pending,
        "attempts": 0,
        "cached": known is not None,
        "output_uri": None,
        "output_sha256": None,
        "finished_at": None,
    }
    if known is not None:
        row.update(
            status=JobStatus.succeeded, output_uri=known[0], output_sha256=known[1], finished_at=now
        )
    return row


def enqueue(
    app: Celery,
    sessions: sessionmaker[Session],
    run_id: int,
    tasks: list[list[int]],
    batching: Batching,
) -> None:
    """Sends one message per task, then marks what the broker took as queued."""
    sent: list[int] = []
    try:
        with app.producer_or_acquire() as producer:
            for job_ids in tasks:
                args = [job_ids, batching.batch_size]
                app.send_task(GENERATE_TASK, args=args, producer=producer)
                sent += job_ids
    except Exception as error:  # kombu raises several kinds for a broker it cannot reach
        raise EnqueueFailed(run_id, len(sent), len(tasks), error) from error
    finally:
        with sessions.begin() as session:
            for chunk in _chunks(sent):
                mark_queued(session, chunk)


def resendable(session: Session, run_id: int) -> list[tuple[int, str]]:
    """Jobs of the run that no live worker holds and that have not finished."""
    now = utcnow()
    rows = session.execute(
        select(Job.id, Job.batch_key, Job.status, Job.lease_expires_at)
        .where(
            Job.run_id == run_id,
            Job.status.not_in(FINISHED),
        )
        .order_by(Job.id)
    )
    return [
        (job_id, key)
        for job_id, key, status, lease in rows
        if status != JobStatus.running or lease is None or as_utc(lease) < now
    ]


def _chunks(ids: list[int]) -> Iterator[list[int]]:
    for start in range(0, len(ids), IN_LIST_LIMIT):
        yield ids[start : start + IN_LIST_LIMIT]
