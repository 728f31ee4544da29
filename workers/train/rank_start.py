"""A rank process's entry point (`python -m sdq.workers.train.rank_start FOLDER [--serve]`):
it arms the parent-death signal before anything else, then imports torch and the rank's
work (rank.py). Armed after those imports, as it once was, a rank whose worker was killed
while it imported lived on for as long as they took (79 s seen) with nobody to stop it."""

import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel kills this process when the worker that started it dies, whatever
    killed the worker (a SIGKILL, the task's hard time limit)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(os.environ["SDQ_RANK_PARENT"]):
        os._exit(1)  # the parent died before the signal was armed


if __name__ == "__main__":
    die_with_parent()
    from sdq.workers.train.rank import main

    main(Path(sys.argv[1]), serving="--serve" in sys.argv[2:])
