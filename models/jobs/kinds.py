"""The table of kinds: each kind of work, the queue it travels on and the pool that runs it.

A row here is the only place a kind is registered. Everything else is found from it by
convention, under the kind's name, in one folder per side: `sdq.producer.<name>`,
`sdq.workers.<name>` and `sdq.models.<name>`. The generic layers reach a kind through what
it declares, in one typed place per side, its `hooks` module's HOOKS (absent: no hooks):

- `sdq.producer.<name>.hooks`: ProducerHooks, the kind's commands and what the generic
  commands show of it.
- `sdq.models.<name>.hooks`: ModelHooks, its settings group, its warm routing and the models
  its runs make.
- `sdq.workers.<name>.hooks`: WorkerHooks, what its worker processes hold, warm up and do
  once a run ends.

Besides those, `sdq.models.<name>.tables` holds the kind's own tables (keyed by job), and
`sdq.workers.<name>.task` its Celery task and work.

Generic code (every module outside the kinds' folders but this one) never names a kind:
tests/test_dependencies.py checks it.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from importlib import import_module
from importlib.util import find_spec
from typing import Any, TypeVar

H = TypeVar("H")


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
    # A queue of its own for work someone waits for (`sdq serve`'s requests), which its
    # workers consume beside the kind's: a worker in the middle of a batch run takes a
    # request as its next message, not after the batch (workers take their queues in turn).
    lane: str | None = None

    @property
    def task_name(self) -> str:
        return f"sdq.{self.name}"

    @property
    def task_module(self) -> str:
        """Where the kind's Celery task and work live; only workers import it."""
        return f"sdq.workers.{self.name}.task"

    def warm_queue(self, key: str) -> str:
        """The queue of the kind's jobs that a worker with `key` warm takes first."""
        return f"{self.queue}{WARM}{key}"

    def producer_hooks(self) -> "ProducerHooks":
        return _hooks(f"sdq.producer.{self.name}.hooks", ProducerHooks)

    def model_hooks(self) -> "ModelHooks":
        return _hooks(f"sdq.models.{self.name}.hooks", ModelHooks)

    def worker_hooks(self) -> "WorkerHooks":
        """Only workers ask: the kind's task comes with them."""
        return _hooks(f"sdq.workers.{self.name}.hooks", WorkerHooks)


@dataclass(frozen=True, kw_only=True)
class ProducerHooks:
    """What a kind adds to the command line and shows through the generic commands."""

    # Its command groups (`sdq <name> ...`), and its commands under `sdq dataset`.
    commands: tuple[Any, ...] = ()
    dataset_commands: tuple[Any, ...] = ()
    # How `sdq resume` does a run of the kind here, without a broker: (app, run_id, jobs)
    # -> None (a train run's bar counts its steps); None: job by job, the bar counting
    # jobs. And what it prints once the run is done, (app, run_id, as_json); None: the
    # run's status.
    resume_here: Callable[..., None] | None = None
    report_run: Callable[..., None] | None = None
    # How `sdq resume --wait` follows a run of the kind on the workers, (app, run_id, *,
    # jobs, show) -> None (a train run's bar counts its steps); None: its jobs.
    watch: Callable[..., None] | None = None
    # The kind's own fields of its jobs (a prompt and seed, a URL...) for the generic
    # listings: (session, job_ids) -> {job_id: fields} where they live in its tables, or
    # (spec) -> fields from one job's spec.
    job_fields: Callable[..., dict[int, dict[str, Any]]] | None = None
    spec_fields: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # What `sdq dataset show` adds of the kind's to a dataset's summary, (session, summary)
    # -> its keys; how it shows them, (summary) -> None; and its section of the dataset's
    # page, (summary, store) -> HTML.
    dataset_summary: Callable[..., dict[str, Any]] | None = None
    show_dataset: Callable[[dict[str, Any]], None] | None = None
    dataset_page: Callable[..., str] | None = None
    # What `sdq metrics` adds of the kind's at each scrape: (session, app) -> Prometheus
    # metric families (a train run's step, speed and loss; `sdq serve`'s requests).
    metrics: Callable[..., Iterable[Any]] | None = None


@dataclass(frozen=True, kw_only=True)
class ModelHooks:
    """What a kind's specs and records give the generic layers."""

    # Its settings group (a dataclass of models/settings.py's `setting`s), read with the
    # others: Settings.group(that class).
    settings: type | None = None
    # (settings) -> the warm key of a job's spec, (spec) -> str | None, or None where the
    # deployment warms nothing: a message goes to the kind's warm queue of its first job's
    # key when a live worker consumes it (workers/routing.py), else to the kind's queue.
    warm_routing: Callable[..., Callable[[dict[str, Any]], str | None] | None] | None = None
    # (session, ref) -> the MadeModel a ref names (a training checkpoint, RUN@STEP or
    # RUN@best:METRIC), or None.
    made_model: Callable[..., "MadeModel | None"] | None = None


@dataclass(frozen=True)
class MadeModel:
    """A model a run made: its name (by the step it is), where its files are in the store,
    its revision, and the run and step that made it. A LoRA run's model is one LoRA file
    (`lora_key`, under the prefix), which renders over its run's base."""

    name: str
    prefix: str
    revision: str
    run: int
    step: int
    lora_key: str | None = None


@dataclass(frozen=True, kw_only=True)
class WorkerHooks:
    """What a kind's worker processes do besides its task."""

    # (app) -> what a process keeps loaded for the kind's next task (its pipelines, its
    # encoders...), whose clear() lets it go: a GPU process serves several kinds in turn and
    # has no room for one's models beside another's, so each task lets the other kinds' go
    # first (workers/holding.py).
    holds: Callable[[Any], Any] | None = None
    # (sessions, store, run_id): what beat does once a run of the kind finishes (a
    # generation run's gallery).
    at_run_end: Callable[..., None] | None = None
    # (settings) -> whether a worker serving the kind warms up before it takes a job, and
    # (app, hostname): what each of its pool processes does then (a generate worker
    # compiles SDQ_WARM_MODELS). Meanwhile the worker consumes none of its queues.
    warms: Callable[[Any], bool] | None = None
    warm_up: Callable[[Any, str], None] | None = None
    # (task): has the worker consume the kind's warm queues of what its process holds now,
    # and no others (workers/routing.py); after every task, before a retry is routed.
    follow: Callable[[Any], None] | None = None


@cache
def _hooks(module: str, kind: type[H]) -> H:
    """A kind's HOOKS in `module`, of the side's hook type; none where it has no module."""
    if find_spec(module) is None:
        return kind()
    hooks = import_module(module).HOOKS
    if not isinstance(hooks, kind):
        raise TypeError(f"{module}.HOOKS is a {type(hooks).__name__}, not {kind.__name__}")
    return hooks


GENERATE = Kind(
    "generate",
    "generate",
    Pool.gpu,
    "images",
    preload=("sdq.workers.generate.pipelines",),
    lane="generate.now",
)
DOWNLOAD = Kind("download", "download", Pool.cpu, "shards")
ENCODE = Kind("encode", "encode", Pool.gpu, "shards", preload=("sdq.workers.encode.encoders",))
TRAIN = Kind("train", "train", Pool.gpu, "train-shards", on_ranks=True)
CURATE = Kind("curate", "curate", Pool.gpu, "shards", preload=("sdq.workers.curate.scoring",))
# Scores models, a training run's checkpoints as they come, on GPUs of its own if need be:
# never on a training rank, and a run's next job never waits for it.
EVALUATE = Kind(
    "evaluate", "evaluate", Pool.gpu, "scores", preload=("sdq.workers.evaluate.metrics",)
)

KINDS = {kind.name: kind for kind in (GENERATE, DOWNLOAD, CURATE, ENCODE, TRAIN, EVALUATE)}

# Every queue, with the pool that consumes it.
POOL_QUEUES = {
    pool: tuple(
        queue
        for kind in KINDS.values()
        if kind.pool is pool
        for queue in (kind.queue, kind.lane)
        if queue is not None
    )
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
