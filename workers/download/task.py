"""The download task: a message of download job ids, one list slice each."""

from functools import cache, partial
from typing import Any

from celery import shared_task

from sdq.models.download.settings import DownloadSettings
from sdq.models.jobs.kinds import DOWNLOAD
from sdq.workers.app import SdqCelery
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.download.fetch import Fetcher
from sdq.workers.download.work import DownloadWork


@shared_task(bind=True, base=JobTask, name=DOWNLOAD.task_name)
def download(self, job_ids: list[int]) -> dict[str, Any]:
    return deliver_task(self, DOWNLOAD, job_ids, partial(download_work, self.app))


def download_work(app: SdqCelery) -> DownloadWork:
    """The work of a message, made as its delivery starts (deliver_task)."""
    settings = app.settings.group(DownloadSettings)
    return DownloadWork(
        store=app.store, sessions=app.sessions, fetcher=fetcher(app), settings=settings
    )


@cache
def fetcher(app: SdqCelery) -> Fetcher:
    """This process's connection pools, made on the first task, after any fork."""
    return Fetcher(app.settings.group(DownloadSettings))
