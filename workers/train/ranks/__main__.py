"""A rank process's entry point (`python -m sdq.workers.train.ranks FOLDER`):
it arms the parent-death signal before anything else, then imports torch and the rank's
work (serve.py). Armed after those imports, as it once was, a rank whose worker was killed
while it imported lived on for as long as they took (79 s seen) with nobody to stop it.
Those imports are loaded for good (sdq.models.loading): left to the collector, they cost a
spare 1-1.3 s of collections as it starts, and a run 0.25-0.3 s of a full collection on
one rank mid-run, the other ranks waiting for it at their next collective."""

import ctypes
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from sdq.models.loading import loaded_for_good

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel kills this process when the worker that started it dies, whatever
    killed the worker (a SIGKILL, the task's hard time limit)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ["SDQ_RANK_PARENT"]):
        os._exit(1)  # the parent died before the signal was armed


def load_rank() -> Callable[[Path], NoReturn]:
    """The rank's work, torch and all, loaded for good."""
    with loaded_for_good():
        from sdq.workers.train.ranks.serve import main
    return main


if __name__ == "__main__":
    die_with_parent()
    load_rank()(Path(sys.argv[1]))
