"""A node's rank processes die with the worker that started them at any moment: their fork
server dies with the worker even while it still imports torch (the parent-death signal is
armed before anything else), and the ranks it forked die with the server. A job given up
while its ranks wait on the server's imports leaves neither behind. And a process doing
device work takes its share of the machine's cores."""

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from sdq.workers.train.ranks.forks import RankServer
from tests.conftest import ROOT
from tests.test_train_rhythm import tiny_run

# Run in a process of its own: it takes in the orphans of the "worker" it starts (a child
# subreaper), so that it can wait for the fork server and the rank, and read how they
# ended. The worker starts the fork server, and with a spec, once the server is up, a rank
# of a run of two that waits for its missing peer; it says their process ids, and is killed.
SCRIPT = textwrap.dedent(
    """
    import ctypes, json, os, subprocess, sys, time
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    worker = subprocess.Popen([sys.executable, "-c", '''
    import json, sys, time
    from pathlib import Path
    from sdq.models.train.specs import TrainShardSpec
    from sdq.workers.train.ranks.forks import rank_server
    from sdq.workers.train.ranks.processes import Node, RankGroup
    pids = [rank_server().process.pid]
    if len(sys.argv) > 1:
        spec = TrainShardSpec.from_dict(json.loads(Path(sys.argv[1]).read_text()))
        pids += [rank.pid for rank in RankGroup(spec, Node(), lambda: None).ranks]
    print(json.dumps(pids), flush=True)
    time.sleep(600)
    ''', *sys.argv[1:]], stdout=subprocess.PIPE, text=True)
    pids = json.loads(worker.stdout.readline())
    time.sleep(0.5)  # without a rank, the server is still importing torch
    worker.kill()
    worker.wait()
    ended = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        ended.append(os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
    print(json.dumps(ended))
    """
)


def signals_ending(*spec_file: Path) -> list[int | None]:
    """The signal that ended the fork server, then each rank (None: it exited), once the
    worker was killed: each has ended by then."""
    ended = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, spec_file)],
        cwd=ROOT, env=os.environ, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ended.returncode == 0, ended.stderr
    return json.loads(ended.stdout.splitlines()[-1])


def test_the_fork_server_dies_with_its_worker_even_while_it_imports() -> None:
    # Killed by the kernel as its parent died, not ended by itself once its imports were
    # done (when it would find nobody left to serve).
    assert signals_ending() == [9]


def test_ranks_die_with_the_fork_server_and_so_with_their_worker(tmp_path: Path) -> None:
    run = tiny_run(tmp_path)
    waiting = replace(run, options=replace(run.options, nodes=2, world_size=2))
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(waiting.to_dict()))
    # The server ends with the worker, at its input's end or by the signal, whichever comes
    # first; its rank is killed as the server dies.
    [_, rank] = signals_ending(spec_file)
    assert rank == 9


class GivenUp(Exception):
    pass


def test_a_job_given_up_while_the_server_imports_stops_it_and_its_rank(tmp_path: Path) -> None:
    """The job's watch is called while the rank waits on the server's imports (a gang's
    member is seen alive so); once it raises, the server is stopped, and the rank it was
    about to fork never runs."""
    server = RankServer()
    looks = 0

    def watch() -> None:
        nonlocal looks
        looks += 1
        if looks == 2:
            raise GivenUp

    environment = {**os.environ, "LOCAL_RANK": "0"}
    with pytest.raises(GivenUp):
        server.fork(tmp_path, tmp_path / "rank0.log", environment, watch)
    assert looks == 2  # a second apart, the server's imports not done
    assert server.process.poll() is not None and server.gone
    assert not (tmp_path / "rank0.log").exists()  # no rank started


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
