"""Something done every few seconds in a thread while other work goes on: lease renewals
beside a job's work, a progress bar's polling beside a run."""

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def every(seconds: float, action: Callable[[], None], *, name: str) -> Iterator[None]:
    """Calls `action` every `seconds` until the body ends, then waits for the thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(seconds):
            action()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
