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
from sdq.producer.cli.common import INTERRUPTED, ctrl_c_kept, watch_progress


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


@pytest.mark.parametrize("ignored", [False, True], ids=["heard", "ignored"])
def test_ctrl_c_is_remembered_unless_the_command_was_started_deaf_to_it(ignored: bool) -> None:
    """A real SIGINT to this process: heard, it interrupts and is remembered; started in the
    background by a script (SIGINT ignored), the command keeps ignoring it."""
    # Python's own handler when heard: a broken ctrl_c_kept fails the test, not the session.
    before = signal.SIG_IGN if ignored else signal.default_int_handler
    previous = signal.signal(signal.SIGINT, before)
    try:
        with ctrl_c_kept() as pressed:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # a signal is handled between two bytecodes: here, at once
                interrupted = False
            except KeyboardInterrupt:
                interrupted = True
            assert (interrupted, pressed()) == (not ignored, not ignored)
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, previous)


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
            assert (interrupted, pressed(), watcher()) == (True, True, None)
        assert sys.unraisablehook is hook
    finally:
        signal.signal(signal.SIGINT, previous)
