"""The Celery side of delivery, written once for every kind: run the work through the
generic skeleton, then turn its outcome into an acknowledgement or a retry."""

import socket
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

from celery import Task
from celery.utils.log import get_logger
from celery.utils.time import get_exponential_backoff_interval
from celery.worker import state as worker_state
from celery.worker.request import Request
from sqlalchemy.pool import NullPool

from sdq.models.db import bound_waits, make_engine, session_factory
from sdq.models.jobs.delivery import Outcome, Work, deliver
from sdq.models.jobs.kinds import KINDS, Kind, Pool
from sdq.models.jobs.lifecycle import Worker, fail, retry_due
from sdq.models.jobs.notices import notices_url, publish, tell_settled
from sdq.workers import sickness
from sdq.workers.app import SdqCelery, worker_identity
from sdq.workers.cores import share_cores
from sdq.workers.holding import hold_for
from sdq.workers.messages import CheckedTask
from sdq.workers.routing import Routes

# Retries of one message: a database outage of hours at the capped backoff, or a job held
# by another worker through many leases. Jobs whose message gives up are still in the
# database, where the relay finds them.
MAX_RETRIES = 50

logger = get_logger(__name__)


class JobTask(CheckedTask):
    """The base of every kind's task: its messages are checked, its retries bounded, and a
    task killed at its hard time limit has its jobs' attempt recorded at once (JobRequest)."""

    max_retries = MAX_RETRIES
    Request = "sdq.workers.delivery:JobRequest"


class JobRequest(Request):
    """A task message as the worker's main process holds it while a pool process runs it."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        # Not in a cold shutdown, where Celery itself records nothing either.
        if not soft and self.worker_pid is not None and not worker_state.should_terminate:
            killed_at_time_limit(self.task, self.args, self.kwargs, self.worker_pid, timeout)


def killed_at_time_limit(
    task: Task, args: list, kwargs: dict[str, Any], pid: int, timeout: float
) -> None:
    """The jobs of a kind's task whose pool process is killed at the hard time limit: their
    attempt failed now, as the main process sees the limit, not once their lease has run out
    (the message is acknowledged, and nothing else would say so); those with attempts left
    are sent again, after the first backoff, to the kind's queue (the process that held
    anything warm for them is gone). It runs in the main process's loop, just before the
    kill: on connections of its own, closed after (the pool processes forked later inherit
    nothing of them), and each wait bounded, so that the kill is late by seconds at most; a
    database or broker it cannot reach leaves the jobs to their lease."""
    kind = next((kind for kind in KINDS.values() if kind.task_name == task.name), None)
    if kind is None or not args:  # a gang's join: the job is its leader's
        return
    app, job_ids = task.app, args[0]
    countdown = app.settings.jobs.retry_backoff_seconds
    try:
        retryable = _fail_killed(app, job_ids, Worker(f"{socket.gethostname()}:{pid}", kind.pool),
                                 f"TimeLimitExceeded: killed at the hard time limit of "
                                 f"{timeout:g} s", countdown)  # fmt: skip
        if retryable:
            with (
                app.connection_for_write() as connection,
                app.producer_or_acquire(app.amqp.Producer(connection)) as producer,
            ):
                app.send_task(kind.task_name, args=[retryable], kwargs=kwargs, queue=kind.queue,
                              countdown=countdown, producer=producer, retry=False,
                              time_limit=None, soft_time_limit=None)  # fmt: skip
    except Exception:
        logger.exception("jobs %s: their attempt killed at the time limit is left to the lease",
                         job_ids)  # fmt: skip


# How long the main process waits on the database for a killed task's jobs: their lease,
# not this, is what heals them when it cannot say so at once.
KILLED_RECORD_SECONDS = 2


def _fail_killed(
    app: SdqCelery, job_ids: list[int], killed: Worker, error: str, countdown: float
) -> list[int]:
    """Records the killed attempt of the jobs `killed` holds, on a connection of its own
    with every wait bounded; returns those with attempts left, their retry due."""
    engine = make_engine(app.settings.database_url, poolclass=NullPool,
                         connect_timeout=KILLED_RECORD_SECONDS)  # fmt: skip
    try:
        sessions = tell_settled(session_factory(engine), notices_url(app.settings))
        with sessions.begin() as session:
            bound_waits(session, KILLED_RECORD_SECONDS)
            retryable = fail(session, job_ids, error=error, permanent=False,
                             settings=app.settings.jobs, worker=killed)  # fmt: skip
            retry_due(session, retryable, datetime.now(UTC) + timedelta(seconds=countdown))
        return retryable
    finally:
        engine.dispose()


def backoff(task: Task) -> float:
    """Exponential, capped, with full jitter, so retries after an outage do not stampede."""
    return get_exponential_backoff_interval(
        task.app.settings.jobs.retry_backoff_seconds,
        task.request.retries,
        task.app.settings.jobs.retry_backoff_max_seconds,
        True,
    )


def deliver_task(
    task: Task,
    kind: Kind,
    job_ids: list[int],
    make_work: Callable[[], Work],
    *,
    on_device: bool = True,
) -> dict[str, Any]:
    """Runs the kind's work on the message's jobs; work `on_device` first has the other
    kinds' models let go (workers/holding.py). The work is made here, inside the guard: a
    failure to set it up (an import cut short by a time limit) is retried like any other."""
    app = task.app
    worker = worker_identity(kind.pool)
    try:
        if on_device:
            hold_for(kind, app)
        if kind.pool is Pool.gpu:
            share_cores()
        outcome = deliver(
            job_ids,
            make_work(),
            kind=kind.name,
            sessions=app.sessions,
            worker=worker,
            settings=app.settings.jobs,
            on_claimed=_told(task, "running"),
        )
    except Exception as error:
        # The work could not be set up, or the database failed outside the work's own
        # bookkeeping. Send the message again later: jobs this delivery claimed are taken
        # over once their lease runs out.
        if task.request.is_eager:
            raise
        raise task.retry(
            exc=error,
            countdown=backoff(task),
            queue=retry_queue(app, kind, job_ids, task.request.kwargs),
        ) from error
    return _settle(task, kind, job_ids, outcome, me=worker.host)


def _settle(task: Task, kind: Kind, job_ids: list[int], outcome: Outcome, *, me: str) -> dict:
    """The delivery's outcome as Celery takes it: acknowledged, or retried (the failed jobs
    after a backoff, those another worker holds once its lease may have run out)."""
    eager = task.request.is_eager  # in the caller's process (`sdq run`): no worker, no broker
    if eager and outcome.outage:
        # A retry would come at once and meet the same outage: the jobs are back (no attempt
        # spent) and the caller says why it stopped.
        raise outcome.outage
    if not eager:
        _after_work(task, kind, job_ids, outcome, me)
    if outcome.put_back:
        _send_again(task, kind, outcome.put_back)
    countdowns = []
    if outcome.retry:
        countdowns.append(backoff(task))
    # In-process runs have no other worker to wait for.
    if outcome.held and not eager:
        countdowns.append(max(1, (outcome.held_until - datetime.now(UTC)).total_seconds() + 1))
    if countdowns:
        again, countdown = outcome.retry + outcome.held, max(countdowns)
        queue = None if eager else _retried(task, kind, outcome.retry, again, countdown)
        raise task.retry(args=[again], countdown=countdown, queue=queue)
    return {"done": len(outcome.done), "reused": len(outcome.reused)}


def _after_work(task: Task, kind: Kind, job_ids: list[int], outcome: Outcome, me: str) -> None:
    """On a worker: its warm queues follow what its process holds now (the kind's `follow`:
    before a retry is routed), and a GPU's failures are counted for its health."""
    if (follow := kind.worker_hooks().follow) is not None:
        try:
            follow(task)
        except Exception:  # the broker failing: the warm queues are followed after the next
            logger.exception("%s: its warm queues were not followed", kind.name)
    if kind.pool is Pool.gpu:
        sickness.after_task(task, job_ids, outcome, me=me)


def _send_again(task: Task, kind: Kind, job_ids: list[int]) -> None:
    """Jobs the work put back undone, in a message of their own now, where a new message
    of them would go. A broker that fails here leaves them queued for beat's relay."""
    try:
        task.apply_async(
            args=[job_ids],
            kwargs=task.request.kwargs,
            queue=retry_queue(task.app, kind, job_ids, task.request.kwargs),
            time_limit=None,
            soft_time_limit=None,
        )
    except Exception:  # kombu raises several kinds for a broker it cannot reach
        logger.exception("jobs %s: put back, not sent again (the relay sends them)", job_ids)


def _told(task: Task, what: str) -> Callable[[list[int]], None]:
    """Tells whoever waits for these jobs (`sdq serve`) that they are `what` now, where the
    notices have a Redis to travel on and a worker sends them (not in-process)."""
    url = notices_url(task.app.settings)
    if url is None or task.request.is_eager:
        return lambda job_ids: None
    return partial(publish, url, what=what)


def _retried(task: Task, kind: Kind, failed: list[int], again: list[int], countdown: float) -> str:
    """When the failed jobs' retry is due (for the relay, should its message be lost), and
    the queue it goes to. A database that fails here leaves the relay the time of the
    failure: the retry is sent all the same."""
    if failed:
        try:
            with task.app.sessions.begin() as session:
                retry_due(session, failed, datetime.now(UTC) + timedelta(seconds=countdown))
        except Exception:
            logger.exception("jobs %s: their retry's due time is not recorded", failed)
    return retry_queue(task.app, kind, again, task.request.kwargs)


def retry_queue(
    app: SdqCelery, kind: Kind, job_ids: list[int], options: Mapping[str, Any] | None = None
) -> str:
    """Where a retry goes: where a new message of these jobs would (workers/routing.py), not
    the queue the message came on. A warm queue whose worker has let go of what made it
    warm (a run's ranks failed, a pipeline evicted) is consumed by nobody any more, and a
    retry sent there would wait for ever; the kind's queue is where any worker takes it.
    The message's task `options` go with it: a request's retry stays on the lane."""
    try:
        return Routes(app.settings, app.sessions, app.control)(kind, [job_ids], options)[0]
    except Exception:  # the database or the broker failing: any worker can take it
        return kind.queue
