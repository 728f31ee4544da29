"""Something done every few seconds in a thread while other work goes on: lease renewals
beside a job's work, a progress bar's polling beside a run."""

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)
# After a failed call, the next comes this soon, then twice as late each time, up to the
# period or `retry_at_most`: a database that restarts for a few seconds misses no more.
FIRST_RETRY_SECONDS = 0.5


@contextmanager
def every(
    seconds: float,
    action: Callable[[], None],
    *,
    name: str,
    retry_at_most: float | None = None,
) -> Iterator[None]:
    """Calls `action` every `seconds` until the body ends, then waits for the thread. An
    error in one call (a database restarting) is logged, and the call tried again sooner,
    with backoff up to `retry_at_most` (else the period): it never ends the thread."""
    stop = threading.Event()
    cap = min(seconds, retry_at_most or seconds)

    def loop() -> None:
        wait, retry = seconds, FIRST_RETRY_SECONDS
        while not stop.wait(wait):
            try:
                action()
            except Exception as error:
                wait, retry = min(retry, cap), retry * 2
                logger.warning("%s failed, tried again in %.1f s: %r", name, wait, error)
            else:
                wait, retry = seconds, FIRST_RETRY_SECONDS

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
