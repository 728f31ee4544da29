"""Beat's periodic tasks on the `maintenance` queue (CPU pool): thin wrappers over the
plain functions in models/jobs/maintenance.py and models/rollups.py."""

from datetime import timedelta
from typing import Any

from celery import shared_task

from sdq.models import rollups
from sdq.models.jobs import maintenance
from sdq.workers.app import MAINTENANCE_TASKS, SdqCelery

SWEEP_LEASES, RELAY, FINISH_RUNS, ROLL_UP = MAINTENANCE_TASKS


@shared_task(bind=True, name=SWEEP_LEASES)
def sweep_leases(self) -> dict[str, Any]:
    sent_back, dead = maintenance.sweep_leases(self.app.sessions, self.app.settings.jobs)
    return ticked(self, {"sent_back": sent_back, "dead": dead})


@shared_task(bind=True, name=RELAY)
def relay(self) -> dict[str, Any]:
    app = self.app
    with app.sender() as send:
        relayed = maintenance.relay(
            app.sessions,
            send,
            relay_after=timedelta(seconds=app.settings.maintenance.relay_after_seconds),
            idle_queues=idle_queues(app),
        )
    return ticked(self, {"jobs": relayed.jobs, "messages": relayed.messages})


@shared_task(bind=True, name=FINISH_RUNS)
def finish_runs(self) -> dict[str, Any]:
    return ticked(self, {"closed": maintenance.finish_runs(self.app.sessions)})


@shared_task(bind=True, name=ROLL_UP)
def roll_up(self) -> dict[str, Any]:
    return ticked(self, {"rows": rollups.roll_up(self.app.sessions)})


def ticked(task, result: dict[str, Any]) -> dict[str, Any]:
    maintenance.record_tick(task.app.sessions, task.name, result)
    return result


def idle_queues(app: SdqCelery) -> set[str]:
    """The queues that hold no message in the broker now: what waits in one is not lost."""
    return {queue for queue, depth in app.queue_depths().items() if depth == 0}
