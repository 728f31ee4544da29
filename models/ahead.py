"""Running what comes next on a thread while the caller works on what it has: the next
chunk of a submit planned while the database takes this one, the next batch of a job
prepared while the device runs this one."""

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
_END = object()


def run_ahead(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Yields what `items` yields, in order, each computed on a thread up to `depth` items
    before the consumer asks for it; an error in `items` is raised where it would have
    been, at its turn."""
    with ThreadPoolExecutor(1, thread_name_prefix="sdq-ahead") as thread:
        # One thread: the next() calls run one at a time, in the order they were asked.
        pending: deque[Future] = deque(thread.submit(next, items, _END) for _ in range(depth))
        while (item := pending.popleft().result()) is not _END:
            pending.append(thread.submit(next, items, _END))
            yield item
