"""`--wait`: a command that watches a run polls often enough to return as the run ends, yet
spends at most a tenth of its time asking the database when a large run's count is slow;
and Ctrl-C stops the watching, even when Python drops its KeyboardInterrupt."""

import os
import signal
import sys
import time
import weakref

import pytest

from sdq.producer import display
from sdq.producer.cli.common import INTERRUPTED, ctrl_c_kept, interrupted_by, watch_progress


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


# The dropped KeyboardInterrupt is this test's premise: pytest reports it as unraisable.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_that_python_drops_still_stops_the_watching() -> None:
    """The press lands in a finalizer, where Python prints "Exception ignored" and drops
    the KeyboardInterrupt: the watch stops at its next poll all the same."""

    class PressedWhileFreed:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs here, inside the finalizer

    polls = 0

    def finished() -> int:
        nonlocal polls
        polls += 1
        if polls == 1:
            PressedWhileFreed()  # freed at once
        return 0 if polls < 50 else 1  # a watch that missed the press ends, unstopped

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(SystemExit) as exited:
            watch_progress(7, "run 7", 1, finished, show=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (exited.value.code, polls) == (INTERRUPTED, 1)


def _not_kept(signum: int, frame: object) -> None:
    raise AssertionError(f"signal {signum} reached the handler set before ctrl_c_kept")


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("ignored", [False, True], ids=["heard", "ignored"])
def test_a_stopping_signal_is_remembered_unless_the_command_was_started_deaf_to_it(
    number: int, ignored: bool
) -> None:
    """A real SIGINT (Ctrl-C) or SIGTERM (`timeout`, a service manager) to this process:
    heard, it interrupts and is remembered, the exit status a shell would give; started deaf
    to it (SIGINT in the background, by a script), the command stays deaf."""
    # A handler of the test's own before: a broken ctrl_c_kept fails the test, not the session.
    before = signal.SIG_IGN if ignored else _not_kept
    previous = signal.signal(number, before)
    try:
        with ctrl_c_kept() as pressed:
            try:
                os.kill(os.getpid(), number)
                time.sleep(1)  # a signal is handled between two bytecodes: here, at once
                interrupt = None
            except KeyboardInterrupt as raised:
                interrupt = raised
            assert pressed() == (None if ignored else number)
        assert signal.getsignal(number) is before
    finally:
        signal.signal(number, previous)
    if not ignored:
        expected = ("Ctrl-C", 130) if number == signal.SIGINT else ("SIGTERM", 143)
        assert interrupted_by(interrupt) == expected
    else:
        assert interrupt is None
    # Raised with words, not by ctrl_c_kept's handler: Ctrl-C's.
    assert interrupted_by(KeyboardInterrupt("stop")) == ("Ctrl-C", 130)


def test_a_ctrl_c_python_drops_in_a_callback_still_stops_the_work() -> None:
    """A SIGINT handled while a weakref callback runs is dropped by Python ("Exception
    ignored in ..."): it is sent again and interrupts the work that goes on after it."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    hook = sys.unraisablehook

    class Held:
        pass

    def collected(reference: weakref.ref) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # handled here, inside the callback, which cannot raise it

    try:
        with ctrl_c_kept() as pressed:
            held = Held()
            watcher = weakref.ref(held, collected)
            try:
                del held  # the callback runs now and drops its KeyboardInterrupt
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the work, which the press must stop
                    time.sleep(0.01)
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            assert (interrupted, pressed(), watcher()) == (True, signal.SIGINT, None)
        assert sys.unraisablehook is hook
    finally:
        signal.signal(signal.SIGINT, previous)
