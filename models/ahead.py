"""Running what comes next on a thread while the caller works on what it has: the next
chunk of a submit planned while the database takes this one, the next batch of a job
prepared while the device runs this one."""

import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
_END = object()


def run_ahead(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """Yields what `items` yields, in order, each computed on a thread up to `depth` items
    before the consumer asks for it; an error in `items` is raised where it would have
    been, at its turn. A consumer that stops, even while it waits for an item, waits for
    the item being made; items not begun are not made."""
    makers: set[int] = set()
    # One thread: the next() calls run one at a time, in the order they were asked.
    thread = ThreadPoolExecutor(
        1, thread_name_prefix="sdq-ahead", initializer=lambda: makers.add(threading.get_ident())
    )
    pending: deque[Future] = deque(thread.submit(next, items, _END) for _ in range(depth))
    try:
        # Taken off only once made: a consumer stopped while it waits still waits for it.
        while (item := pending[0].result()) is not _END:
            pending.popleft()
            pending.append(thread.submit(next, items, _END))
            yield item
    finally:
        started = [future for future in pending if not future.cancel()]
        thread.shutdown(wait=False)
        # Waited for through its future, the thread not joined: on Python 3.11 a join that
        # Ctrl-C interrupts marks the thread ended while it runs on (CPython gh-90882), and
        # the interpreter could finalize under it, an abort where it was in torch; the exit
        # joins it instead. Closed by a collection on that very thread, it cannot wait.
        if threading.get_ident() not in makers:
            wait(started)
