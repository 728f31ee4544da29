"""Entry point for the Celery command line: `celery -A sdq.workers.main worker -Q generate`."""

from importlib import import_module

from celery.signals import celeryd_after_setup

from sdq.models.jobs.kinds import KINDS
from sdq.models.settings import Settings
from sdq.workers import (
    memory,  # noqa: F401  (registers the device_memory control command)
    sickness,
)
from sdq.workers.app import create_app, quiet_libraries

quiet_libraries()
app = create_app(Settings.from_env())


@celeryd_after_setup.connect
def load_gpu_libraries(sender, instance, **_) -> None:
    """A worker imports what the kinds it serves preload (the GPU libraries come with them)
    once, in its main process before the pool forks (importing makes no CUDA context):
    never inside a task, where a time limit could cut an import short and leave the process
    unable to import them again, nor on the first task's clock. A CPU pool's worker never
    imports them."""
    consumed = set(instance.app.amqp.queues.consume_from or instance.app.amqp.queues)
    for kind in KINDS.values():
        if kind.queue in consumed:
            for module in kind.preload:
                import_module(module)


@celeryd_after_setup.connect
def back_in_rotation(sender: str, instance, **_) -> None:
    """A worker (re)started takes jobs: whatever its last run was taken out of rotation for
    (workers/sickness.py) is forgotten."""
    sickness.forget(instance.app.settings.database_url, sender)
