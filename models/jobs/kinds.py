"""The table of kinds: each kind of work, the queue it travels on and the pool that runs it.

A row here is the only place a kind is registered. Everything else is found from it by
convention, under the kind's name:

- `sdq.producer.<name>.cli`: COMMANDS, the kind's command groups (`sdq <name> ...`);
  optionally DATASET_COMMANDS, its commands under `sdq dataset` (`sdq dataset filter`); and,
  optionally, `report_run(app, run_id, as_json)`, what `sdq resume` prints once a run of
  the kind is done here (else the run's status).
- `sdq.producer.<name>.lookups`: `job_fields(session, job_ids)`, the kind's own columns of
  its jobs (a prompt and seed, a URL...) for the generic listings, or `spec_fields(spec)`,
  the same read from one job's spec.
- `sdq.models.<name>.tables`, if the kind has rows of its own (keyed by job), and
  `.specs`, its jobs' specification; optionally `.models`, whose `made_model(session,
  ref)` resolves a model the kind's runs made (its prefix in the store and revision); and
  optionally `.routing`, whose `warm_routing(settings)` gives the warm key of a job's spec
  (None: no warm queue for it), or None where the deployment warms nothing: a message goes
  to the kind's warm queue of its first job's key when a live worker consumes it
  (workers/routing.py), else to the kind's queue.
- `sdq.workers.<name>.task`: the kind's Celery task and its work; optionally,
  `at_run_end(sessions, store, run_id)`, what beat does once a run of the kind finishes (a
  generation run's gallery); and optionally `warms(settings)`, whether a worker serving
  the kind warms up before it takes a job, and `warm_up(app, hostname)`, what each of its
  pool processes does then (a generate worker compiles SDQ_WARM_MODELS): meanwhile the
  worker consumes none of its queues (workers/main.py).

Generic code (models/jobs/, producer/cli/, producer/lookups.py, producer/launch.py,
workers/app.py, workers/main.py, workers/maintenance.py, workers/delivery.py) never names a
kind: tests/test_dependencies.py checks it.
"""

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from importlib import import_module
from importlib.util import find_spec
from types import ModuleType


class Pool(StrEnum):
    gpu = "gpu"  # one process per GPU, one task at a time
    cpu = "cpu"  # many processes; never imports torch


MAINTENANCE_QUEUE = "maintenance"  # beat's periodic tasks, on the CPU pool
# Between a kind's queue and a warm key: `generate.warm.<key>`.
WARM = ".warm."


@dataclass(frozen=True)
class Kind:
    name: str
    queue: str
    pool: Pool
    unit: str  # what one job makes, in words: "images", "shards"...
    # Modules a worker serving the kind imports once, in its main process before the pool
    # forks (the GPU libraries come with them), never inside a task.
    preload: tuple[str, ...] = ()
    # Its jobs run on rank processes over GPUs of their own: `sdq worker gpu --train-ranks
    # N` gives the kind a worker of N GPUs, which serve nothing else.
    on_ranks: bool = False

    @property
    def task_name(self) -> str:
        return f"sdq.{self.name}"

    @property
    def task_module(self) -> str:
        """Where the kind's Celery task and work live; only workers import it."""
        return f"sdq.workers.{self.name}.task"

    def producer_module(self, part: str) -> ModuleType:
        """The kind's `cli` or `lookups` module (see above)."""
        return import_module(f"sdq.producer.{self.name}.{part}")

    def cli_hook(self, name: str) -> Callable | None:
        """The kind's optional hook `name` in its `cli` module (see above), or None."""
        return getattr(self.producer_module("cli"), name, None)

    def warm_queue(self, key: str) -> str:
        """The queue of the kind's jobs that a worker with `key` warm takes first."""
        return f"{self.queue}{WARM}{key}"

    def model_hook(self, name: str, module: str = "models") -> Callable | None:
        """The kind's optional hook `name` in `sdq.models.<kind>.<module>`, or None."""
        path = f"sdq.models.{self.name}.{module}"
        return getattr(import_module(path), name, None) if find_spec(path) else None

    def task_hook(self, name: str) -> Callable | None:
        """The kind's optional hook `name` in its `task` module (see above), or None."""
        return getattr(import_module(self.task_module), name, None)


GENERATE = Kind(
    "generate", "generate", Pool.gpu, "images", preload=("sdq.workers.generate.pipelines",)
)
DOWNLOAD = Kind("download", "download", Pool.cpu, "shards")
ENCODE = Kind("encode", "encode", Pool.gpu, "shards", preload=("sdq.workers.encode.encoders",))
TRAIN = Kind("train", "train", Pool.gpu, "train-shards", on_ranks=True)
CURATE = Kind("curate", "curate", Pool.gpu, "shards", preload=("sdq.workers.curate.scoring",))

KINDS = {kind.name: kind for kind in (GENERATE, DOWNLOAD, CURATE, ENCODE, TRAIN)}

# Every queue, with the pool that consumes it.
POOL_QUEUES = {
    pool: tuple(kind.queue for kind in KINDS.values() if kind.pool is pool)
    + ((MAINTENANCE_QUEUE,) if pool is Pool.cpu else ())
    for pool in Pool
}
QUEUES = tuple(queue for queues in POOL_QUEUES.values() for queue in queues)


def import_tables() -> None:
    """Every kind's own tables, into the schema's metadata (for migrations to compare)."""
    for kind in KINDS:
        if find_spec(f"sdq.models.{kind}.tables") is not None:
            import_module(f"sdq.models.{kind}.tables")


class UnknownKind(Exception):
    pass


def kind_named(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(f"no kind of work named {name!r}; known: {', '.join(KINDS)}") from None
