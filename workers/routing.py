"""Where each task message goes: to a queue that a worker with the message's work warm
consumes (a kind's `warm_routing` hook, models/jobs/kinds.py), where such a worker is
consuming now, else to its kind's queue, which every worker of the kind consumes.

Which queues live workers consume is asked over Celery's control channel, once per
sending, and only where a kind routes to warm queues under the deployment's settings: a
warm queue whose worker has died has no consumer, and its kind's queue is used instead. A
worker sending the next jobs of its own work (a train run's next job) asks nothing: the warm
queues it consumes are the live ones it needs, and asking would cost a second of the task's
time limit."""

from collections.abc import Callable, Collection, Mapping
from typing import Any

from celery import Celery
from celery.app.control import Control
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.kinds import KINDS, WARM, Kind
from sdq.models.settings import Settings
from sdq.models.tables import Job

# How long live workers have to say which queues they consume.
REPLY_SECONDS = 1.0


def warm_key(kind: Kind, settings: Settings) -> Callable[[dict[str, Any]], str | None] | None:
    """The kind's warm key of a job's spec under these settings; None: it routes nothing."""
    routing = kind.model_hooks().warm_routing
    return routing(settings) if routing is not None else None


def live_warm_queues(settings: Settings, control: Control) -> set[str]:
    """The warm queues live workers consume now; none asked for where no kind routes."""
    if not any(warm_key(kind, settings) for kind in KINDS.values()):
        return set()
    answered = control.inspect(timeout=REPLY_SECONDS).active_queues() or {}
    return {queue["name"] for queues in answered.values() for queue in queues
            if WARM in queue["name"]}  # fmt: skip


def queues_of(control: Control, node: str) -> list[str]:
    """The queues worker `node` consumes now, warm ones included, as it answers."""
    answered = control.inspect(destination=[node], timeout=REPLY_SECONDS).active_queues() or {}
    return sorted(queue["name"] for queue in answered.get(node, []))


class Routes:
    """The queue of each message one sending sends; live warm queues asked once, unless
    the sender knows them (`live`: a worker's own). Messages of a run someone waits for
    (its task options say `waited`: `sdq serve`'s requests, their retries and re-sends
    alike) go to the kind's lane, whatever their warm key: a warm queue is first in, first
    out behind a batch run's messages, and every worker warms the deployment's models."""

    def __init__(
        self,
        settings: Settings,
        sessions: sessionmaker[Session],
        control: Control,
        live: set[str] | None = None,
    ) -> None:
        self.settings, self.sessions, self.control = settings, sessions, control
        self._warm = live

    def __call__(
        self, kind: Kind, messages: list[list[int]], options: Mapping[str, Any] | None = None
    ) -> list[str]:
        if kind.lane is not None and (options or {}).get("waited"):
            return [kind.lane] * len(messages)
        key = warm_key(kind, self.settings)
        if key is None:
            return [kind.queue] * len(messages)
        first_specs = self._specs([job_ids[0] for job_ids in messages])
        wanted = [key(first_specs[job_ids[0]]) for job_ids in messages]
        live = self.warm() if any(wanted) else set()
        return [
            queue if warm and (queue := kind.warm_queue(warm)) in live else kind.queue
            for warm in wanted
        ]

    def warm(self) -> set[str]:
        if self._warm is None:
            self._warm = live_warm_queues(self.settings, self.control)
        return self._warm

    def _specs(self, job_ids: Collection[int]) -> dict[int, dict[str, Any]]:
        with self.sessions() as session:
            return dict(session.execute(select(Job.id, Job.spec).where(Job.id.in_(job_ids))).all())


# The warm queues each kind's work in this process has had its worker consume.
_following: dict[str, set[str]] = {}


def consume_warm_queues(app: Celery, hostname: str, kind: Kind, keys: Collection[str]) -> None:
    """Has worker `hostname` consume the kind's warm queue of each key, and none of the
    kind's other warm queues it consumed for this process: through Celery's control
    channel, which the worker's main process serves while its pool runs a task (its answer
    to the next `active_queues` comes after it)."""
    warm = {kind.warm_queue(key) for key in keys}
    following = _following.setdefault(kind.name, set())
    for queue in sorted(warm - following):
        app.control.add_consumer(queue, destination=[hostname])
    for queue in sorted(following - warm):
        app.control.cancel_consumer(queue, destination=[hostname])
    following.clear()
    following.update(warm)


def own_warm_queues() -> set[str]:
    """The warm queues this process has had its worker consume: live while it is."""
    return set().union(*_following.values())
