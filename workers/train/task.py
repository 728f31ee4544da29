"""The train task: a message of one train-shard job id."""

from functools import cache
from typing import Any

from celery import shared_task

from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.outbox import enqueue
from sdq.workers.app import SdqCelery
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.train.work import LiveStates, TrainWork
from sdq.workers.weights import ModelFiles


@shared_task(bind=True, base=JobTask, name=TRAIN.task_name)
def train(self, job_ids: list[int]) -> dict[str, Any]:
    app = self.app

    def work() -> TrainWork:
        return TrainWork(
            store=app.store,
            sessions=app.sessions,
            files=ModelFiles(app.store, app.settings.model_cache_dir),
            live=live_states(),
            # In-process runs (`sdq train` embedded) go on to the next job by themselves.
            send_next=(lambda _run: None) if self.request.is_eager else send_next(app),
        )

    return deliver_task(self, TRAIN, job_ids, work)


@cache
def live_states() -> LiveStates:
    return LiveStates()


def send_next(app: SdqCelery):
    def send(run_id: int) -> None:
        """Sends the run's job that the last checkpoint wrote (the outbox's send: a job it
        cannot send now stays queued for `sdq requeue` and the relay)."""
        with app.sender() as sender:
            enqueue(app.sessions, sender, run_id)

    return send
