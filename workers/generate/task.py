"""The generate task: a message of job ids, rendered `batch_size` images per call."""

from collections.abc import Callable
from functools import cache, partial
from time import perf_counter
from typing import Any

import redis
from celery import Task, shared_task
from celery.utils.log import get_task_logger

from sdq.models.generate import galleries
from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import GenerationSpec
from sdq.models.jobs.kinds import GENERATE
from sdq.models.jobs.notices import broker_redis, notices_url
from sdq.models.registry import resolve_model
from sdq.models.settings import Settings
from sdq.workers.app import SdqCelery
from sdq.workers.consuming import consumed
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.generate.work import GenerateWork
from sdq.workers.routing import consume_warm_queues
from sdq.workers.weights import ModelFiles

logger = get_task_logger(__name__)


@shared_task(bind=True, base=JobTask, name=GENERATE.task_name)
def generate(
    self, job_ids: list[int], batch_size: int | None = None, waited: bool = False
) -> dict[str, Any]:
    return deliver_task(self, GENERATE, job_ids, partial(generate_work, self, batch_size, waited))


def generate_work(task: Task, batch_size: int | None, waited: bool) -> GenerateWork:
    """The work of a message, made as its delivery starts (deliver_task)."""
    app = task.app
    return GenerateWork(
        store=app.store,
        sessions=app.sessions,
        pipelines=pipelines(app),
        batch_size=batch_size or app.settings.group(GenerateSettings).batch_size,
        give_way=(lambda: False) if waited else lane_waiting(task),
    )


def lane_waiting(task: Task) -> Callable[[], bool]:
    """Whether a request waits on the kind's lane (`sdq serve`): a worker in the middle of
    a batch message gives way at its next pipeline call. Only a worker that consumes the
    lane gives way (another would put its batch back for a request it never takes), and
    never in-process, or on a broker other than Redis (one LLEN a call)."""
    url = notices_url(task.app.settings)
    if url is None or task.request.is_eager or GENERATE.lane not in consumed(task.app):
        return lambda: False
    return partial(_queued, url, GENERATE.lane)


def _queued(url: str, queue: str) -> bool:
    try:
        return broker_redis(url).llen(queue) > 0
    except redis.RedisError:
        return False  # the batch goes on; the request waits its turn


def follow_warm_queues(task: Task) -> None:
    """Has this worker take jobs from the queue of each pipeline and shape this process
    has warm (models/generate/routing.py), where submits send those first, and from no
    warm queue of a pipeline it has let go."""
    if task.request.is_eager:  # done in-process (embedded): there is no worker
        return
    app = task.app
    consume_warm_queues(app, task.request.hostname, GENERATE, pipelines(app).warm_keys())


def warms(settings: Settings) -> bool:
    """Whether a generate worker warms up before it takes a job (workers/main.py)."""
    return bool(settings.group(GenerateSettings).warm_models)


def warm_up(app: SdqCelery, hostname: str) -> None:
    """Loads each of SDQ_WARM_MODELS, compiled at every batch size of SDQ_WARM_SHAPES,
    and has the worker consume their warm queues: before it takes a job."""
    cache = pipelines(app)
    for name in app.settings.group(GenerateSettings).warm_models:
        with app.sessions() as session:
            model = resolve_model(name, store=app.store, session=session)
        started = perf_counter()
        cache.get(GenerationSpec.warming(model))
        logger.info("warm: model %s loaded and compiled in %.1f s", name, perf_counter() - started)
    consume_warm_queues(app, hostname, GENERATE, cache.warm_keys())


# Once a generation run finishes, beat writes its gallery: a run submitted without --wait
# has its page without anyone asking.
at_run_end = galleries.write_gallery


@cache
def pipelines(app: SdqCelery):
    """This process's loaded pipelines, made on the first task, after any fork."""
    from sdq.workers.generate.pipelines import PipelineCache
    from sdq.workers.generate.shared_prompts import SharedPrompts

    settings = app.settings.group(GenerateSettings)
    shared = settings.prompt_cache_url and SharedPrompts(
        settings.prompt_cache_url, settings.shared_prompt_cache_size
    )
    return PipelineCache(
        files=ModelFiles(app.store, app.settings.model_cache_dir),
        size=settings.pipeline_cache_size,
        prompt_cache_size=settings.prompt_cache_size,
        shared_prompts=shared or None,
        compile_mode=settings.compile_mode,
        compile_batches=settings.compile_batches,
        warm_shapes=settings.warm_shapes,
        compile_backend=settings.compile_backend,
        lora_swap_rank=settings.lora_swap_rank,
        channels_last=settings.channels_last,
    )
