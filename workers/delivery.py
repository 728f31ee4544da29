"""The Celery side of delivery, written once for every kind: run the work through the
generic skeleton, then turn its outcome into an acknowledgement or a retry."""

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import Task
from celery.utils.time import get_exponential_backoff_interval

from sdq.models.jobs.delivery import Work, deliver
from sdq.models.jobs.kinds import Kind, Pool
from sdq.workers import sickness
from sdq.workers.app import worker_identity
from sdq.workers.holding import hold
from sdq.workers.messages import CheckedTask

# Retries of one message: a database outage of hours at the capped backoff, or a job held
# by another worker through many leases. Jobs whose message gives up are still in the
# database, where the relay finds them.
MAX_RETRIES = 50


class JobTask(CheckedTask):
    """The base of every kind's task: its messages are checked, its retries bounded."""

    max_retries = MAX_RETRIES


def backoff(task: Task) -> float:
    """Exponential, capped, with full jitter, so retries after an outage do not stampede."""
    return get_exponential_backoff_interval(
        task.app.settings.jobs.retry_backoff_seconds,
        task.request.retries,
        task.app.settings.jobs.retry_backoff_max_seconds,
        True,
    )


def deliver_task(
    task: Task, kind: Kind, job_ids: list[int], make_work: Callable[[], Work]
) -> dict[str, Any]:
    """Runs the kind's work on the message's jobs. The work is made here, inside the guard:
    a failure to set it up (an import cut short by a time limit) is retried like any other."""
    app = task.app
    worker = worker_identity(kind.pool)
    try:
        hold(kind, app)
        outcome = deliver(
            job_ids,
            make_work(),
            kind=kind.name,
            sessions=app.sessions,
            worker=worker,
            settings=app.settings.jobs,
        )
    except Exception as error:
        # The work could not be set up, or the database failed outside the work's own
        # bookkeeping. Send the message again later: jobs this delivery claimed are taken
        # over once their lease runs out.
        if task.request.is_eager:
            raise
        raise task.retry(exc=error, countdown=backoff(task)) from error
    if kind.pool is Pool.gpu and not task.request.is_eager:
        sickness.after_task(task, job_ids, outcome, me=worker.host)
    if outcome.outage and task.request.is_eager:
        # In the caller's process (`sdq run`) a retry would come at once and meet the same
        # outage: the jobs are back (no attempt spent) and the caller says why it stopped.
        raise outcome.outage
    countdowns = []
    if outcome.retry:
        countdowns.append(backoff(task))
    # In-process runs (`sdq run`) have no other worker to wait for.
    if outcome.held and not task.request.is_eager:
        countdowns.append(max(1, (outcome.held_until - datetime.now(UTC)).total_seconds() + 1))
    if countdowns:
        raise task.retry(args=[outcome.retry + outcome.held], countdown=max(countdowns))
    return {"done": len(outcome.done), "reused": len(outcome.reused)}
