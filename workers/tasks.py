"""Celery tasks: thin wrappers that turn a work function's outcome into acks and retries."""

from datetime import UTC, datetime

from celery import shared_task
from celery.utils.time import get_exponential_backoff_interval

from workers.app import GENERATE_TASK
from workers.generate import generate_batch

MAX_BACKOFF_SECONDS = 600


def backoff(task) -> float:
    return get_exponential_backoff_interval(
        task.app.settings.retry_backoff_seconds, task.request.retries, MAX_BACKOFF_SECONDS, True
    )


@shared_task(bind=True, name=GENERATE_TASK, max_retries=None)
def generate(self, job_ids: list[int], batch_size: int) -> dict[str, int]:
    app = self.app
    try:
        outcome = generate_batch(
            job_ids,
            batch_size=batch_size,
            sessions=app.sessions,
            store=app.store,
            pipelines=app.pipelines,
            worker=app.worker,
            settings=app.settings,
        )
    except Exception as error:
        # The database failed outside the work's own bookkeeping. Send the message again
        # later: jobs this delivery claimed are taken over once their lease runs out.
        if self.request.is_eager:
            raise
        raise self.retry(exc=error, countdown=backoff(self)) from error
    countdowns = []
    if outcome.retry:
        countdowns.append(backoff(self))
    # In-process runs (`sdq run`) have no other worker to wait for.
    if outcome.held and not self.request.is_eager:
        countdowns.append(max(1, (outcome.held_until - datetime.now(UTC)).total_seconds() + 1))
    if countdowns:
        raise self.retry(args=[outcome.retry + outcome.held, batch_size], countdown=max(countdowns))
    return {"rendered": len(outcome.rendered), "cached": len(outcome.cached)}
