"""`--wait`: a command that watches a run polls often enough to return as the run ends, yet
spends at most a tenth of its time asking the database when a large run's count is slow."""

import time

from sdq.producer import display


def test_a_slow_count_is_asked_at_most_a_tenth_of_the_time() -> None:
    asked: list[float] = []

    def finished() -> int:
        started = time.perf_counter()
        time.sleep(0.03)  # a large run's count, slower than the poll interval's tenth
        asked.append(time.perf_counter() - started)
        return len(asked)

    started = time.perf_counter()
    display.watch("run 1", 4, finished, show=False, poll_seconds=0.01)
    waited = time.perf_counter() - started
    assert len(asked) == 4  # it stopped at the poll that saw the end
    # Each ask but the last is followed by a wait of at least nine times its length.
    assert sum(asked[:-1]) * 10 <= waited - asked[-1]
