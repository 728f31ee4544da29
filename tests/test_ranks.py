"""A rank process dies with the worker that started it at any moment, even while it is
still importing torch: the parent-death signal is armed before anything else."""

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

# Run in a process of its own: it takes in the orphans of the "worker" it starts (a child
# subreaper), so that it can wait for the rank and read how it ended.
SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, subprocess, sys, time
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    worker = subprocess.Popen([sys.executable, "-c", '''
    import os, subprocess, sys, time
    env = {**os.environ, "SDQ_RANK_PARENT": str(os.getpid()), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    rank = subprocess.Popen([sys.executable, "-m", "sdq.workers.train.ranks",
                             sys.argv[1]], env=env)
    print(rank.pid, flush=True)
    time.sleep(600)
    ''', sys.argv[1]], stdout=subprocess.PIPE, text=True)
    rank = int(worker.stdout.readline())
    time.sleep(0.5)  # the rank is importing torch, which takes longer
    worker.kill()
    worker.wait()
    _, status = os.waitpid(rank, 0)
    print(json.dumps({"signaled": os.WIFSIGNALED(status),
                      "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}))
    """
)


def test_a_rank_dies_with_its_worker_even_while_it_imports(tmp_path) -> None:
    ended = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ended.returncode == 0, ended.stderr
    # Killed by the kernel as its parent died, not ended by itself once its imports were
    # done (when it used to arm the signal, and exit 1 on finding its parent gone).
    assert json.loads(ended.stdout.splitlines()[-1]) == {"signaled": True, "signal": 9}


def threads_when_working_here(omp: str | None) -> int:
    """torch's threads in a fresh process once it does device work, as a worker does."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if omp:
        env["OMP_NUM_THREADS"] = omp
    script = (
        "import torch; from sdq.workers.cores import share_cores; "
        "share_cores(); print(torch.get_num_threads())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env={**env, "PYTHONPATH": str(ROOT.parent)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(done.stdout)


def test_device_work_in_a_process_takes_its_share_of_the_cores() -> None:
    """Not torch's default (every core), which a busy CPU turns into threads waiting on one
    another; OMP_NUM_THREADS, when set, decides."""
    cores = len(os.sched_getaffinity(0))
    assert threads_when_working_here(None) == max(1, cores // 2)
    assert threads_when_working_here(str(cores)) == cores
