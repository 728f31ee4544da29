"""Entry point for the Celery command line: `celery -A sdq.workers.main worker -Q generate`."""

import logging
import os
import sys
from collections.abc import Iterable
from importlib import import_module
from time import monotonic

from celery.signals import celeryd_after_setup, worker_process_init

from sdq.models.jobs.kinds import KINDS, Kind
from sdq.models.loading import loaded_for_good
from sdq.models.settings import Settings
from sdq.workers import (
    memory,  # noqa: F401  (registers the device_memory control command)
    sickness,
)
from sdq.workers.app import NAME_TAKEN, create_app, quiet_libraries
from sdq.workers.consuming import consumed, held_back

quiet_libraries()
app = create_app(Settings.from_env())


@celeryd_after_setup.connect
def refuse_a_taken_name(sender: str, instance, **_) -> None:
    """A worker whose node name a live worker already has does not start: jobs and calls
    are sent to a worker by its name (a run's gang calls its members so), and two workers of
    one name would take each other's. It asks before its own control channel listens, so
    any answer is another's; Celery itself only warns, and goes on."""
    app = instance.app
    # On a connection of its own, closed after: one left in the app's pool mid-read would
    # be what each pool process forked later tries to close, and waits on for ever.
    with app.connection_for_write() as connection:
        taken = app.control.ping(
            destination=[sender], timeout=NAME_CHECK_SECONDS, connection=connection
        )
    if taken:
        print(
            f"sdq: a worker named {sender} is already alive on this deployment's broker; "
            "this one stops. Start another with a name of its own (one `sdq worker` per "
            "host, or another --hostname).",
            file=sys.stderr,
            flush=True,
        )
        os._exit(NAME_TAKEN)  # before the pool and the consumer start: nothing to clean up


# How long a starting worker waits for another of its name to answer.
NAME_CHECK_SECONDS = 1.0


@celeryd_after_setup.connect
def load_gpu_libraries(sender, instance, **_) -> None:
    """A worker imports what the kinds it serves preload (the GPU libraries come with them)
    once, in its main process before the pool forks (importing makes no CUDA context):
    never inside a task, where a time limit could cut an import short and leave the process
    unable to import them again, nor on the first task's clock. A CPU pool's worker never
    imports them."""
    preload(served_kinds(instance.app))


def preload(kinds: Iterable[Kind]) -> None:
    """The kinds' modules, loaded for good (sdq.models.loading) before the pool forks: the
    pool's processes, which do the work, never walk their objects again."""
    with loaded_for_good():
        for kind in kinds:
            for module in kind.preload:
                import_module(module)


@celeryd_after_setup.connect
def back_in_rotation(sender: str, instance, **_) -> None:
    """A worker (re)started takes jobs: whatever its last run was taken out of rotation for
    (workers/sickness.py) is forgotten."""
    sickness.forget(instance.app.settings.database_url, sender)


def served_kinds(app) -> list[Kind]:
    return [kind for kind in KINDS.values() if kind.queue in consumed(app)]


# Set in a warming worker's main process before its pool forks (hold_queues_while_warming),
# read by each pool process once warm: the kinds that warm up, and the worker's name (the
# queues held back are consuming.held_back).
_warming: list[Kind] = []
_hostname: list[str] = []


@celeryd_after_setup.connect
def hold_queues_while_warming(sender: str, instance, **_) -> None:
    """A worker serving a kind that warms up (its WorkerHooks' `warms(settings)`: a
    generate worker with SDQ_WARM_MODELS) consumes none of its queues until its pool
    process has warmed up, so that no job waits behind a compilation on a worker that
    took it first; each process gets as long to warm up as a task of those kinds to run."""
    app = instance.app
    warms = {kind: kind.worker_hooks().warms for kind in served_kinds(app)}
    warming = [kind for kind, hook in warms.items() if hook is not None and hook(app.settings)]
    if not warming:
        return
    _warming[:], _hostname[:] = warming, [sender]
    held_back[:] = sorted(app.amqp.queues.consume_from)
    app.amqp.queues.deselect(held_back)
    limits = app.settings.time_limits
    app.conf.worker_proc_alive_timeout = max(limits[kind.queue].hard for kind in warming)


@worker_process_init.connect
def warm_up(**_) -> None:
    """In each pool process of a warming worker: the kinds' `warm_up(app, hostname)`, then
    its queues taken back. A warm-up that fails is logged, and the worker takes jobs
    anyway: a job's own load then says what is wrong."""
    if not held_back:
        return
    _until_listening()
    for kind in _warming:
        try:
            kind.worker_hooks().warm_up(app, _hostname[0])
        except Exception:
            logging.getLogger(__name__).exception("%s: warming up failed", kind.name)
    for queue in held_back:
        app.control.add_consumer(queue, destination=_hostname)


def _until_listening(seconds: float = 120.0) -> None:
    """Until the worker answers on its control channel, which it opens while this process
    starts: a command sent before it listens is lost (the broker hands a broadcast only
    to those listening then)."""
    deadline = monotonic() + seconds
    while not app.control.ping(destination=_hostname, timeout=1.0):
        if monotonic() > deadline:
            logging.getLogger(__name__).error("%s did not answer for %d s", _hostname[0], seconds)
            return
