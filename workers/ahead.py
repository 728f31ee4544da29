"""Running the CPU side of a pipeline ahead of the device: while the GPU works on one
item, a thread prepares the next ones."""

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
_END = object()


def run_ahead(items: Iterator[T], depth: int) -> Iterator[T]:
    """Yields what `items` yields, in order, each computed on a thread up to `depth` items
    before the consumer asks for it; an error in `items` is raised where it would have
    been, at its turn."""
    with ThreadPoolExecutor(1, thread_name_prefix="sdq-ahead") as thread:
        # One thread: the next() calls run one at a time, in the order they were asked.
        pending: deque[Future] = deque(thread.submit(next, items, _END) for _ in range(depth))
        while (item := pending.popleft().result()) is not _END:
            pending.append(thread.submit(next, items, _END))
            yield item


def ahead_of_device(items: Iterator[T], depth: int, device: "torch.device") -> Iterator[T]:
    """`run_ahead` when the device is a GPU. On the CPU the host is the device: what ran
    ahead would take the cores that the model's own threads are using, and both would
    wait on each other (the curate benchmark's jobs: 0.85x of a plain loop with the
    batches decoded ahead, 1.0x with each decoded in its turn)."""
    return items if device.type == "cpu" else run_ahead(items, depth)
