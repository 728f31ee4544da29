"""The table of kinds: each kind of work, the queue it travels on and the pool that runs it.

Adding a kind is a row here, its folder under workers/ (its `task` module: the work and a
Celery task of a few lines) and its folder under producer/ (its input and planning).
"""

from dataclasses import dataclass
from enum import StrEnum


class Pool(StrEnum):
    gpu = "gpu"  # one process per GPU, one task at a time
    cpu = "cpu"  # many processes; never imports torch


# Every queue, with the pool that consumes it; beat's periodic tasks use `maintenance`.
POOL_QUEUES = {
    Pool.gpu: ("generate", "encode", "train"),
    Pool.cpu: ("download", "maintenance"),
}
QUEUES = tuple(queue for queues in POOL_QUEUES.values() for queue in queues)
MAINTENANCE_QUEUE = "maintenance"


@dataclass(frozen=True)
class Kind:
    name: str
    queue: str

    @property
    def pool(self) -> Pool:
        return next(pool for pool, queues in POOL_QUEUES.items() if self.queue in queues)

    @property
    def task_name(self) -> str:
        return f"sdq.{self.name}"

    @property
    def task_module(self) -> str:
        """Where the kind's Celery task and work live; only workers import it."""
        return f"sdq.workers.{self.name}.task"


GENERATE = Kind("generate", queue="generate")
DOWNLOAD = Kind("download", queue="download")
ENCODE = Kind("encode", queue="encode")
TRAIN = Kind("train", queue="train")

KINDS = {kind.name: kind for kind in (GENERATE, DOWNLOAD, ENCODE, TRAIN)}


class UnknownKind(Exception):
    pass


def kind_named(name: str) -> Kind:
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(f"no kind of work named {name!r}; known: {', '.join(KINDS)}") from None
