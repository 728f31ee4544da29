"""The Celery app: queues, routes and the delivery settings the job lifecycle relies on.

The producer imports this module to send tasks by name; it never imports the tasks.
"""

import os
import socket
from functools import cached_property
from typing import TYPE_CHECKING

from celery import Celery
from kombu import Queue
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from models.db import make_engine, session_factory
from models.lifecycle import Worker
from models.settings import Settings
from models.store import ObjectStore, open_store

if TYPE_CHECKING:
    from workers.pipelines import PipelineCache

QUEUES = ("generate", "download", "encode", "train", "maintenance")
GPU_QUEUES = ("generate", "encode", "train")
CPU_QUEUES = ("download", "maintenance")
GENERATE_TASK = "sdq.generate"
ROUTES = {GENERATE_TASK: {"queue": "generate"}}


class SdqCelery(Celery):
    """A Celery app that carries sdq's settings and builds its resources lazily, after fork."""

    settings: Settings

    @cached_property
    def engine(self) -> Engine:
        return make_engine(self.settings.database_url)

    @cached_property
    def sessions(self) -> sessionmaker[Session]:
        return session_factory(self.engine)

    @cached_property
    def store(self) -> ObjectStore:
        return open_store(self.settings.store_url)

    @cached_property
    def pipelines(self) -> "PipelineCache":
        from workers.pipelines import PipelineCache

        return PipelineCache(
            store=self.store,
            cache_dir=self.settings.model_cache_dir,
            size=self.settings.pipeline_cache_size,
        )

    @cached_property
    def worker(self) -> Worker:
        from workers.pipelines import describe_device

        return Worker(host=f"{socket.gethostname()}:{os.getpid()}", device=describe_device())


def create_app(settings: Settings) -> SdqCelery:
    app = SdqCelery("sdq", broker=settings.broker_url or "memory://", include=["workers.tasks"])
    app.settings = settings
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
        task_soft_time_limit=settings.task_soft_time_limit,
        task_time_limit=settings.task_time_limit,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue="maintenance",
        task_routes=ROUTES,
        worker_send_task_events=True,
    )
    return app
