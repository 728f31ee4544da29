"""The evaluate task: a message of one evaluate job, a model scored by its metrics."""

from functools import cache, partial
from typing import Any

from celery import shared_task

from sdq.models.jobs.kinds import EVALUATE
from sdq.workers.app import SdqCelery
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.evaluate.work import EvaluateWork
from sdq.workers.weights import ModelFiles


@shared_task(bind=True, base=JobTask, name=EVALUATE.task_name)
def evaluate(self, job_ids: list[int]) -> dict[str, Any]:
    """Scores a model: a train run's checkpoint as it is written, or any model."""
    return deliver_task(self, EVALUATE, job_ids, partial(evaluate_work, self.app))


def evaluate_work(app: SdqCelery) -> EvaluateWork:
    return EvaluateWork(store=app.store, sessions=app.sessions, models=loaded_models(app))


@cache
def loaded_models(app: SdqCelery):
    """This process's U-Net and CLIP model, made on the first task, after any fork."""
    from sdq.workers.evaluate.metrics import LoadedModels

    return LoadedModels(ModelFiles(app.store, app.settings.model_cache_dir), app.store)
