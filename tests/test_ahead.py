"""run_ahead: the CPU side of a pipeline computed ahead of its consumer, in order, with
errors raised at their turn."""

import os
import signal
import threading
import time

import pytest
import torch

from sdq.models.ahead import run_ahead
from sdq.workers.ahead import ahead_of_device
from tests.services import wait_for


def test_items_come_in_order_computed_ahead_on_another_thread() -> None:
    made: list[int] = []
    threads: set[str] = set()
    progress = threading.Condition()

    def items():
        for n in range(6):
            with progress:
                threads.add(threading.current_thread().name)
                made.append(n)
                progress.notify_all()
            yield n

    ahead = run_ahead(items(), depth=2)
    assert next(ahead) == 0
    # The next two are made while the consumer holds the first, without asking.
    with progress:
        assert progress.wait_for(lambda: len(made) == 3, timeout=30)
    assert list(ahead) == [1, 2, 3, 4, 5]
    assert threading.current_thread().name not in threads


def test_an_error_is_raised_at_its_turn_after_the_items_before_it() -> None:
    def items():
        yield 1
        yield 2
        raise ValueError("shard 3 is unreadable")

    got = []
    with pytest.raises(ValueError, match="shard 3 is unreadable"):
        for item in run_ahead(items(), depth=2):
            got.append(item)
    assert got == [1, 2]


def test_a_second_ctrl_c_while_it_waits_for_the_thread_leaves_the_thread_known_alive() -> None:
    """A consumer that stops waits for the item being made; Ctrl-C during that wait stops
    the waiting, and the thread is still known to be running until it ends, so the exit
    waits for it. A Thread.join that Ctrl-C interrupts (Python 3.11) marked it ended
    while it ran on: the interpreter then finalized under it."""
    making, release = threading.Event(), threading.Event()

    def items():
        yield 0
        making.set()
        release.wait(60)  # the item being made when the consumer stops
        yield 1

    before = set(threading.enumerate())
    ahead = run_ahead(items())
    assert next(ahead) == 0
    assert making.wait(60)
    [thread] = set(threading.enumerate()) - before
    # The press comes while close() waits: the thread cannot end before release is set.
    press = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    press.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ahead.close()
        assert thread.is_alive()
    finally:
        press.cancel()
        release.set()
    thread.join(60)
    assert not thread.is_alive()


def test_a_consumer_stopped_while_it_waits_for_an_item_still_waits_for_it() -> None:
    """Ctrl-C as the consumer waits for the next item (the producer the slow side): the
    item is still waited for, so nothing the thread uses (the writer's session, a device)
    is let go under it. The item is let finish only once the press has landed."""
    making, pressed, made = threading.Event(), threading.Event(), threading.Event()

    def items():
        making.set()
        assert pressed.wait(60)
        made.set()
        yield 0

    def ctrl_c(*_) -> None:
        pressed.set()
        raise KeyboardInterrupt

    def press() -> None:
        if making.wait(60):
            time.sleep(0.2)  # the consumer is in next(), waiting for the item
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.signal(signal.SIGINT, ctrl_c)
    presser = threading.Thread(target=press)
    try:
        ahead = run_ahead(items())
        presser.start()
        with pytest.raises(KeyboardInterrupt):
            next(ahead)
        assert made.is_set()
    finally:
        making.set()
        presser.join(60)
        signal.signal(signal.SIGINT, handler)
        pressed.set()


@pytest.mark.parametrize(("device", "ahead"), [("cuda", True), ("cpu", False)])
def test_only_a_gpu_has_its_batches_made_ahead(device: str, ahead: bool) -> None:
    """On the CPU the host is the device: nothing is made before it is asked for."""
    made: list[str] = []

    def items():
        for n in range(3):
            made.append(threading.current_thread().name)
            yield n

    batches = ahead_of_device(items(), 2, torch.device(device))
    assert next(batches) == 0
    if ahead:
        wait_for(lambda: len(made) == 3, what="two batches made ahead")
    else:
        assert len(made) == 1
    assert list(batches) == [1, 2]
    on_the_caller = [name == threading.current_thread().name for name in made]
    assert on_the_caller == [not ahead] * 3
