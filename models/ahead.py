"""Running what comes next on a thread while the caller works on what it has: the next
chunk of a submit planned while the database takes this one, the next batch of a job
prepared while the device runs this one."""

from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
_END = object()


def run_ahead(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Yields what `items` yields, in order, each computed on a thread up to `depth` items
    before the consumer asks for it; an error in `items` is raised where it would have
    been, at its turn. A consumer that stops early waits for the item being made."""
    # One thread: the next() calls run one at a time, in the order they were asked.
    thread = ThreadPoolExecutor(1, thread_name_prefix="sdq-ahead")
    pending: deque[Future] = deque(thread.submit(next, items, _END) for _ in range(depth))
    try:
        while (item := pending.popleft().result()) is not _END:
            pending.append(thread.submit(next, items, _END))
            yield item
    finally:
        started = [future for future in pending if not future.cancel()]
        thread.shutdown(wait=False)
        # The item being made is waited for, the thread not joined: on Python 3.11 a join
        # that Ctrl-C interrupts marks the thread ended while it runs on (CPython
        # gh-90882), and the interpreter would exit under it, an abort where it was in torch.
        wait(started)
