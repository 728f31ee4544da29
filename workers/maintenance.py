"""Beat's periodic tasks on the `maintenance` queue (CPU pool): thin wrappers over the
plain functions in models/jobs/maintenance.py and models/rollups.py."""

from datetime import datetime, timedelta
from typing import Any

from celery import shared_task

from sdq.models import rollups
from sdq.models.jobs import maintenance
from sdq.models.jobs.kinds import WARM, kind_named
from sdq.models.jobs.lifecycle import utcnow
from sdq.workers.app import MAINTENANCE_TASKS, SdqCelery
from sdq.workers.routing import live_warm_queues

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
    """Closes finished runs, then does each kind's run-end work (its `at_run_end`) for every
    run that finished since this task last ran (or in the last hour, the first time). A
    tick that fails is covered by the next."""
    app = self.app
    last = maintenance.last_tick(app.sessions, self.name)
    # Back a little from the last tick: a run closed while that tick was writing is not missed.
    since = last - timedelta(minutes=1) if last else utcnow() - timedelta(hours=1)
    closed = maintenance.finish_runs(app.sessions)
    return ticked(self, {"closed": closed, "ended": end_runs(app, since)})


def end_runs(app: SdqCelery, since: datetime) -> int:
    """Each run finished since `since` given its kind's run-end work; returns how many."""
    ended = maintenance.runs_finished_since(app.sessions, since)
    for kind, run_id in ended:
        at_run_end = kind_named(kind).worker_hooks().at_run_end
        if at_run_end is not None:
            at_run_end(app.sessions, app.store, run_id)
    return len(ended)


@shared_task(bind=True, name=ROLL_UP)
def roll_up(self) -> dict[str, Any]:
    return ticked(self, {"rows": rollups.roll_up(self.app.sessions)})


def ticked(task, result: dict[str, Any]) -> dict[str, Any]:
    maintenance.record_tick(task.app.sessions, task.name, result)
    return result


def idle_queues(app: SdqCelery) -> set[str]:
    """The queues that hold no message in the broker now: what waits in one is not lost.
    A kind's jobs wait in its live warm queues too (workers/routing.py): its queue counts
    as idle only when they are empty as well."""
    warm = live_warm_queues(app.settings, app.control)
    idle = {queue for queue, depth in app.queue_depths(warm).items() if depth == 0}
    return {queue for queue in idle
            if all(w in idle for w in warm if w.startswith(f"{queue}{WARM}"))}  # fmt: skip
