"""A GPU worker whose device keeps failing is taken out of rotation, as a load balancer
drops a sick backend: alive, it would take job after job and fail each one.

Each pool process counts its tasks that failed on the device in a row (out of memory, CUDA
errors), each a device fault that gives its jobs back without spending an attempt. Once
SDQ_SICK_AFTER of those tasks' jobs have been done by other workers (so the jobs were not
what failed), the worker records itself in `sick_workers`, says why in its log, and stops
consuming its queues. `sdq health` and the metrics show it; a restart, or
`sdq worker clear NAME`, puts it back."""

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from celery import Celery, Task
from sqlalchemy import delete, select

from sdq.models.db import make_engine, session_factory, upsert
from sdq.models.faults import device_failure
from sdq.models.jobs.delivery import Outcome
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.tables import FINISHED, Job, JobStatus, SickWorker
from sdq.workers.routing import queues_of

logger = logging.getLogger(__name__)

# This process's tasks that failed on the device since its last success, by task id (a
# retry keeps it: a task failed ten times is one): their job ids, the last few dozen tasks,
# enough to judge by, however long a lone worker keeps failing.
REMEMBERED_TASKS = 64
_failed_in_a_row: OrderedDict[str, list[int]] = OrderedDict()
# Other workers do the given-back jobs after the failure that gave them back, and a worker
# may take no more jobs after it (another took every retry): it looks again this often
# until it is judged, works again, or every failed job is finished.
LOOK_AGAIN_SECONDS = 5.0
_looking_again: threading.Timer | None = None
# The task's thread and the looking-again timer judge one at a time, on what is then known.
_judging = threading.Lock()


@dataclass(frozen=True)
class Suspect:
    """The worker whose device failed, as a judgement outside its task needs it."""

    app: Celery
    node: str  # its Celery node, whose queues it stops consuming
    host: str  # its jobs' worker_host
    queues: list[str]  # what it consumes if it does not answer for itself
    error: str


def after_task(task: Task, job_ids: list[int], outcome: Outcome, *, me: str) -> None:
    """Counts the task's outcome; takes the worker out once its device is seen sick."""
    if outcome.outage is not None and device_failure(outcome.outage):
        with _judging:
            _failed_in_a_row[task.request.id] = job_ids
            _failed_in_a_row.move_to_end(task.request.id)
            if len(_failed_in_a_row) > REMEMBERED_TASKS:
                _failed_in_a_row.popitem(last=False)
        consumed = task.app.amqp.queues.consume_from or [task.request.delivery_info["routing_key"]]
        judge(Suspect(task.app, task.request.hostname, me, sorted(consumed), str(outcome.error)))
    elif outcome.done:  # rendered on the device; outputs reused from the store never touch it
        with _judging:
            _failed_in_a_row.clear()


def judge(suspect: Suspect) -> None:
    """Takes the worker out if enough of its failed tasks' jobs were done elsewhere, else
    looks again in a few seconds while any of those jobs is unfinished."""
    with _judging:
        if _looking_again is not None:
            _looking_again.cancel()
        failed = list(_failed_in_a_row.values())
        if not failed:
            return
        try:
            done_elsewhere, unfinished = _fates(suspect, failed)
            if done_elsewhere >= suspect.app.settings.jobs.sick_after:
                take_out(suspect, f"{len(failed)} tasks in a row failed on the device, "
                                  f"on jobs other workers then did: {suspect.error}")  # fmt: skip
                # Judged: put back in rotation (`sdq worker clear`), it is judged afresh.
                _failed_in_a_row.clear()
                return
        except Exception:  # the database or the broker away: judged again in a few seconds
            logger.exception("%s: its failed device was not judged", suspect.node)
            _look_again(suspect)
            return
        if unfinished:
            _look_again(suspect)


def _look_again(suspect: Suspect) -> None:
    global _looking_again
    _looking_again = threading.Timer(LOOK_AGAIN_SECONDS, judge, args=[suspect])
    _looking_again.daemon = True
    _looking_again.start()


def _fates(suspect: Suspect, failed: list[list[int]]) -> tuple[int, bool]:
    """How many of the failed tasks had a job that another worker has since done, and
    whether any of their jobs is unfinished."""
    with suspect.app.sessions() as session:
        rows = session.execute(
            select(Job.id, Job.status, Job.worker_host).where(
                Job.id.in_([i for ids in failed for i in ids])
            )
        ).all()
    done = {
        job for job, status, host in rows if status == JobStatus.succeeded and host != suspect.host
    }
    unfinished = any(status not in FINISHED for _, status, _ in rows)
    return sum(1 for ids in failed if done & set(ids)), unfinished


def take_out(suspect: Suspect, reason: str) -> None:
    app, name = suspect.app, suspect.node
    # As the worker answers: its warm queues (workers/routing.py) came after this process
    # forked, and its copy of the queues it consumes has none of them.
    queues = queues_of(app.control, name) or suspect.queues
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
