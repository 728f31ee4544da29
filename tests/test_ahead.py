"""run_ahead: the CPU side of a pipeline computed ahead of its consumer, in order, with
errors raised at their turn."""

import threading

import pytest

from sdq.workers.ahead import run_ahead


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
