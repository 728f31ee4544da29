"""The encode task: a message of encode job ids, one image shard each."""

from functools import cache, partial
from typing import Any

from celery import shared_task

from sdq.models.jobs.kinds import ENCODE
from sdq.workers.app import SdqCelery
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.encode.work import EncodeWork
from sdq.workers.weights import ModelFiles


@shared_task(bind=True, base=JobTask, name=ENCODE.task_name)
def encode(self, job_ids: list[int], batch_size: int) -> dict[str, Any]:
    return deliver_task(self, ENCODE, job_ids, partial(encode_work, self.app, batch_size))


def encode_work(app: SdqCelery, batch_size: int) -> EncodeWork:
    """The work of a message, made as its delivery starts (deliver_task)."""
    return EncodeWork(
        store=app.store, sessions=app.sessions, encoders=encoders(app), batch_size=batch_size
    )


@cache
def encoders(app: SdqCelery):
    """This process's loaded encoders, made on the first task, after any fork."""
    from sdq.workers.encode.encoders import LoadedEncoders

    return LoadedEncoders(ModelFiles(app.store, app.settings.model_cache_dir))
