"""A GPU worker whose device keeps failing is taken out of rotation, as a load balancer
drops a sick backend: alive, it would take job after job and fail each one.

Each pool process counts its tasks that failed on the device in a row (out of memory, CUDA
errors), each a device fault that gives its jobs back without spending an attempt. Once
SDQ_SICK_AFTER of those tasks' jobs have been done by other workers (so the jobs were not
what failed), the worker records itself in `sick_workers`, says why in its log, and stops
consuming its queues. `sdq health` and the metrics show it; a restart, or
`sdq worker clear NAME`, puts it back."""

import logging
from collections import deque

from celery import Task
from sqlalchemy import delete, select

from sdq.models.db import make_engine, session_factory, upsert
from sdq.models.faults import device_failure
from sdq.models.jobs.delivery import Outcome
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.tables import Job, JobStatus, SickWorker
from sdq.workers.routing import queues_of

logger = logging.getLogger(__name__)

# This process's tasks that failed on the device since its last success, their job ids:
# the last few dozen, enough to judge by, however long a lone worker keeps failing.
_failed_in_a_row: deque[list[int]] = deque(maxlen=64)


def after_task(task: Task, job_ids: list[int], outcome: Outcome, *, me: str) -> None:
    """Counts the task's outcome; takes the worker out once its device is seen sick."""
    if outcome.outage is not None and device_failure(outcome.outage):
        _failed_in_a_row.append(job_ids)
        if _done_elsewhere(task, me) >= task.app.settings.jobs.sick_after:
            take_out(task, f"{len(_failed_in_a_row)} tasks in a row failed on the device, "
                           f"on jobs other workers then did: {outcome.error}")  # fmt: skip
    elif outcome.done or outcome.reused:
        _failed_in_a_row.clear()


def _done_elsewhere(task: Task, me: str) -> int:
    """How many of the failed tasks had a job that another worker has since done."""
    with task.app.sessions() as session:
        done = set(
            session.scalars(
                select(Job.id).where(
                    Job.id.in_([i for ids in _failed_in_a_row for i in ids]),
                    Job.status == JobStatus.succeeded,
                    Job.worker_host != me,
                )
            )
        )
    return sum(1 for ids in _failed_in_a_row if done & set(ids))


def take_out(task: Task, reason: str) -> None:
    app, name = task.app, task.request.hostname
    # As the worker answers: its warm queues (workers/routing.py) came after this process
    # forked, and its copy of the queues it consumes has none of them.
    queues = queues_of(app.control, name) or sorted(
        app.amqp.queues.consume_from or [task.request.delivery_info["routing_key"]]
    )
    with app.sessions.begin() as session:
        row = {"worker": name, "queues": queues, "reason": reason, "since": utcnow()}
        statement = upsert(session, SickWorker).values(row)
        session.execute(statement.on_conflict_do_update(index_elements=["worker"], set_=row))
    logger.error(
        "sick, taking no more jobs from %s: %s. `sdq worker clear %s` or a restart brings it "
        "back", ", ".join(queues), reason, name,
    )  # fmt: skip
    for queue in queues:
        app.control.cancel_consumer(queue, destination=[name])


def forget(database_url: str, name: str) -> None:
    """A worker (re)started is in rotation: whatever its last run was taken out for."""
    engine = make_engine(database_url)
    try:
        with session_factory(engine).begin() as session:
            session.execute(delete(SickWorker).where(SickWorker.worker == name))
    finally:
        engine.dispose()
