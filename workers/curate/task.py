"""The curate task: a message of curate job ids, one image shard each, or one dedup job of
a filtered dataset (all its members, or one cluster of them)."""

from functools import cache, partial
from typing import Any

from celery import shared_task

from sdq.models.jobs.kinds import CURATE
from sdq.workers.app import SdqCelery
from sdq.workers.curate.dedup import DedupWork
from sdq.workers.curate.work import CurateWork
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.weights import ModelFiles


@shared_task(bind=True, base=JobTask, name=CURATE.task_name)
def curate(self, job_ids: list[int], batch_size: int = 64, dedup: bool = False) -> dict[str, Any]:
    """Scores image shards; or, for a filtered dataset's run (`dedup`), finds near-duplicates."""
    work = partial(dedup_work, self) if dedup else partial(curate_work, self.app, batch_size)
    # Near-duplicates are found on the CPU: the device's models stay as they are.
    return deliver_task(self, CURATE, job_ids, work, on_device=not dedup)


def dedup_work(task) -> DedupWork:
    app = task.app
    return DedupWork(store=app.store, sessions=app.sessions, send_added=app.send_added_jobs(task))


def curate_work(app: SdqCelery, batch_size: int) -> CurateWork:
    """The work of a message, made as its delivery starts (deliver_task)."""
    return CurateWork(
        store=app.store, sessions=app.sessions, scorers=scorers(app), batch_size=batch_size
    )


@cache
def scorers(app: SdqCelery):
    """This process's loaded CLIP model and heads, made on the first task, after any fork."""
    from sdq.workers.curate.scoring import LoadedScorers

    return LoadedScorers(ModelFiles(app.store, app.settings.model_cache_dir), app.store)
