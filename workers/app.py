"""The Celery app: queues, routes and the delivery settings the job lifecycle relies on.

The producer imports this module to send tasks by name; it never imports the tasks.
"""

import os
import socket
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import cache, cached_property
from typing import Any

from celery import Celery, Task
from kombu import Queue
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.kinds import KINDS, MAINTENANCE_QUEUE, QUEUES, Kind, Pool
from sdq.models.jobs.lifecycle import Worker
from sdq.models.jobs.notices import notices_url, tell_settled
from sdq.models.jobs.outbox import Send, enqueue
from sdq.models.settings import Settings
from sdq.models.store import ObjectStore, open_store
from sdq.workers.routing import Routes, own_warm_queues

# The exit code of a worker that refused to start because a live worker has its node name
# (workers/main.py): its launcher does not start it again.
NAME_TAKEN = 78  # EX_CONFIG

# Beat's periodic tasks (workers/maintenance.py), all on the maintenance queue, each with
# the setting (of MaintenanceSettings) that says how often: healing often, rollups less.
MAINTENANCE_TASKS = {
    "sdq.maintenance.sweep_leases": "interval_seconds",
    "sdq.maintenance.relay": "interval_seconds",
    "sdq.maintenance.finish_runs": "interval_seconds",
    "sdq.maintenance.roll_up": "rollup_interval_seconds",
}


class SdqCelery(Celery):
    """A Celery app that carries sdq's settings and builds its resources lazily, after fork."""

    settings: Settings

    @cached_property
    def engine(self) -> Engine:
        # Made by the commands that make runs (and `sdq db upgrade`), never by a look.
        return make_engine(self.settings.database_url, create=False)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        # Whoever waits on a job (`sdq serve`) hears when a transaction settles it.
        return tell_settled(session_factory(self.engine), notices_url(self.settings))

    @cached_property
    def store(self) -> ObjectStore:
        return open_store(self.settings.store_url)

    def let_go(self) -> None:
        """What this process holds for the kinds' work let go (workers/holding.py): the
        embedded run's worker, as its command stops."""
        from sdq.workers.holding import let_go_of_all

        let_go_of_all()

    def queue_depths(self, warm: Collection[str] = ()) -> dict[str, int]:
        """Messages waiting in each of sdq's queues (and these warm ones) in the broker now
        (a message a worker has taken but not yet acknowledged is not waiting)."""
        queues = [*self.conf.task_queues, *map(Queue, warm)]
        with self.connection_for_read() as connection:
            channel = connection.default_channel
            return {queue.name: queue.bind(channel).queue_declare().message_count
                    for queue in queues}  # fmt: skip

    def send_added_jobs(self, task: Task) -> Callable[[int], None]:
        """What a job that adds jobs to its run (the next train job, a dedup's clusters) calls
        once they are committed: the outbox's send, which leaves a job it cannot send now
        queued for `sdq requeue` and the relay. A run done in-process (embedded) goes on to
        them by itself."""
        if task.request.is_eager:
            return lambda run_id: None

        def send(run_id: int) -> None:
            # The warm queues this worker consumes are live, and a run's next job is most
            # often for one of them: asking every worker (a second's wait, inside the
            # task's time limit) is not needed.
            with self.sender(live_warm=own_warm_queues()) as sender:
                enqueue(self.sessions, sender, run_id)

        return send

    @contextmanager
    def sender(self, live_warm: set[str] | None = None) -> Iterator[Send]:
        """Sends task messages over one broker connection, each to its kind's queue or a
        warm one (workers/routing.py): one of `live_warm` where given, else one that live
        workers say they consume. On Redis a call's messages go in one pipeline (kombu's
        publish batch): a round trip per call instead of one per message, a third of the
        time for a big submit."""
        routes = Routes(self.settings, self.sessions, self.control, live_warm)
        with self.producer_or_acquire() as producer:

            def send(kind: Kind, messages: list[list[int]], options: dict[str, Any]) -> None:
                queues = routes(kind, messages, options)
                with producer.batch(max_size=len(messages)):
                    for job_ids, queue in zip(messages, queues, strict=True):
                        self.send_task(
                            kind.task_name,
                            args=[job_ids],
                            kwargs=options,
                            queue=queue,
                            producer=producer,
                            # None, said outright: Celery would otherwise stamp the
                            # sending process's limits for the task on the message, and a
                            # worker obeys those over its own.
                            time_limit=None,
                            soft_time_limit=None,
                            # What Flower and the worker's log show of the message. Given
                            # here, it is not Celery's saferepr of every id: a fifth of a big
                            # submit's sending.
                            argsrepr=f"[{len(job_ids)} jobs: {job_ids[0]}..{job_ids[-1]}]",
                            kwargsrepr=repr(options),
                        )

            yield send


@cache
def worker_identity(pool: Pool) -> Worker:
    """Who does the work, as the job history records it: host:pid and the device. Asked
    for only by tasks, so always in the process that runs them, after any fork."""
    device = "cpu"
    if pool is Pool.gpu:
        # Only GPU work loads torch; a CPU worker names its device without it.
        from sdq.workers.gpu import describe_device

        device = describe_device()
    return Worker(host=f"{socket.gethostname()}:{os.getpid()}", device=device)


def quiet_libraries() -> None:
    """Called at the entry points, before any GPU module loads: transformers warns at import
    about image processors that Stable Diffusion pipelines never use, and both libraries
    log loading details that say nothing to an sdq user."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")


class QueueLimits:
    """Celery's annotation of each task with the time limits of its kind's queue: the
    kind's task, and the tasks named under it (`sdq.<kind>.<part>`: a part of a job runs
    as long as the job)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def annotate(self, task: Task) -> dict[str, int] | None:
        for kind in KINDS.values():
            if task.name == kind.task_name or task.name.startswith(f"{kind.task_name}."):
                limits = self.settings.time_limits[kind.queue]
                return {"soft_time_limit": limits.soft, "time_limit": limits.hard}
        return None


def create_app(settings: Settings) -> SdqCelery:
    """The Celery app every process uses: sdq's queues, routes, limits and beat."""
    app = SdqCelery(
        "sdq",
        broker=settings.broker_url or "memory://",
        include=[*(kind.task_module for kind in KINDS.values()), "sdq.workers.maintenance"],
        task_cls="sdq.workers.messages:CheckedTask",
    )
    app.settings = settings
    general = settings.time_limits[MAINTENANCE_QUEUE]
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        # Postgres is the record of every outcome; a result backend would be a second one.
        task_ignore_result=True,
        # Acknowledge after the work, and give the message back if the process dies, so a
        # killed worker's batch is delivered again; Postgres caps how often (max_attempts).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # GPU workers take one batch at a time; a prefetched batch would wait behind it
        # while another GPU sits idle.
        worker_prefetch_multiplier=1,
        task_soft_time_limit=general.soft,
        task_time_limit=general.hard,
        # Each kind's tasks run under its queue's limits, as the worker's own settings
        # have them (no message names any): training runs far longer.
        task_annotations=[QueueLimits(settings)],
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue=MAINTENANCE_QUEUE,
        task_routes={kind.task_name: {"queue": kind.queue} for kind in KINDS.values()},
        worker_send_task_events=True,
        beat_schedule=beat_schedule(settings),
    )
    return app


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Beat's periodic tasks, each at its interval."""
    return {
        name: {
            "task": name,
            "schedule": getattr(settings.maintenance, interval),
            # A tick nobody ran in time is dropped, not piled up behind a stopped pool.
            "options": {"expires": getattr(settings.maintenance, interval)},
        }
        for name, interval in MAINTENANCE_TASKS.items()
    }
