"""Starting workers: one process per GPU, each seeing only its own; one that dies is started
again while the others work on; stopping them cleanly."""

import os
import re
import resource
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psycopg
import pytest

from sdq.models.jobs.kinds import POOL_QUEUES, TRAIN, Pool
from sdq.producer.launch import (
    MALLOC_MMAP_THRESHOLD,
    MALLOC_TRIM_THRESHOLD,
    Supervised,
    WorkerCommand,
    cpu_workers,
    gpu_workers,
)
from tests.conftest import BUCKET, ROOT, WorkerProcess, run_sdq
from tests.services import wait_for

GPU_QUEUES = POOL_QUEUES[Pool.gpu]
# What a GPU serves when training has GPUs of its own: every other GPU queue.
RENDERING = tuple(queue for queue in GPU_QUEUES if queue != TRAIN.queue)


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_one_worker_per_gpu_each_with_its_own_device() -> None:
    commands = gpu_workers(["0", "3"], loglevel="info")
    assert [command.env["CUDA_VISIBLE_DEVICES"] for command in commands] == ["0", "3"]
    for command, gpu in zip(commands, ["0", "3"], strict=True):
        assert command.argv[1:6] == ["-m", "celery", "-A", "sdq.workers.main", "worker"]
        assert option(command.argv, "--queues") == ",".join(GPU_QUEUES)
        assert option(command.argv, "--concurrency") == "1"
        assert option(command.argv, "--prefetch-multiplier") == "1"
        assert option(command.argv, "--hostname") == f"gpu{gpu}@%h"
        assert "--without-mingle" in command.argv  # sdq revokes nothing to sync at start


def test_without_gpus_one_cpu_process_renders() -> None:
    [command] = gpu_workers([], loglevel="info")
    assert command.env["CUDA_VISIBLE_DEVICES"] == ""
    assert option(command.argv, "--hostname") == "cpu-render@%h"
    [pool] = cpu_workers(6, loglevel="warning")
    assert option(pool.argv, "--queues") == "download,maintenance"
    assert option(pool.argv, "--concurrency") == "6"


def test_training_gpus_serve_training_only_and_queues_narrow_the_others() -> None:
    commands = gpu_workers(["0", "1", "2", "3", "4"], loglevel="info", ranks=4)
    [train, render] = commands
    assert train.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert train.env["SDQ_TRAIN_RANKS"] == "4"  # the most a job may start there
    assert option(train.argv, "--queues") == "train"
    assert option(train.argv, "--hostname") == "train@%h"
    assert render.env["CUDA_VISIBLE_DEVICES"] == "4"
    assert option(render.argv, "--queues") == ",".join(RENDERING)
    # Every GPU trains: no other worker; the others serve only the queues asked for.
    [only] = gpu_workers(["0", "1"], loglevel="info", ranks=2)
    assert option(only.argv, "--queues") == "train"
    renderers = gpu_workers(["0", "1"], loglevel="info", queues=("generate",))
    assert [option(c.argv, "--queues") for c in renderers] == ["generate", "generate"]
    # Without GPUs: a train worker of its own (CPU ranks) beside the one that renders.
    train, render = gpu_workers([], loglevel="info", ranks=2)
    assert (option(train.argv, "--queues"), train.env["CUDA_VISIBLE_DEVICES"]) == ("train", "")
    assert option(render.argv, "--queues") == ",".join(RENDERING)


# A model's layers on the CPU, batch after batch: each activation is 3200 x 1024 floats.
FORWARDS = """
import resource, torch
torch.set_num_threads(1)
block = lambda: torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256), torch.nn.LayerNorm(256)
)
model, batch = torch.nn.Sequential(*[block() for _ in range(4)]), torch.randn(3200, 256)
with torch.inference_mode():
    model(batch)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        model(batch)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
MALLOC = (MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD)
ACTIVATION_PAGES = 3200 * 1024 * 4 // resource.getpagesize()


def page_faults(env: dict[str, str]) -> int:
    """Page faults of ten forwards after the first, in a process with this environment."""
    done = subprocess.run([sys.executable, "-c", FORWARDS], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return int(done.stdout)


def test_every_gpu_pool_worker_reuses_its_freed_host_buffers() -> None:
    default = {key: value for key, value in os.environ.items() if key not in MALLOC}
    # glibc maps buffers over its threshold afresh and unmaps them when freed, so every
    # forward zero-fills its activations again page by page. Its default threshold starts
    # at 128 KiB and rises only when a mapped buffer happens to be freed first (the same
    # script saw 4,000 or 57,000 faults from one run to the next): held at its start, as
    # any malloc setting holds it, the faults are certain.
    mapped_afresh = {**default, MALLOC_MMAP_THRESHOLD: str(128 << 10)}
    assert page_faults(mapped_afresh) >= 10 * ACTIVATION_PAGES
    commands = [
        *gpu_workers(["0", "1"], loglevel="info", ranks=1),
        *gpu_workers([], loglevel="info"),
    ]
    # One setting for them all (a process of torch each is slow to start), which ends it:
    # the heap may still grow by an activation or two as it settles (CI saw exactly one),
    # but not by one a forward.
    [settings] = {
        tuple(sorted((key, value) for key, value in command.env.items() if key in MALLOC))
        for command in commands
    }
    assert settings and page_faults({**default, **dict(settings)}) <= 2 * ACTIVATION_PAGES


def test_the_worker_command_checks_its_queues_and_ranks(sdq) -> None:
    unknown = sdq("worker", "gpu", "--queues", "generate,download")
    assert unknown.exit_code == 2
    assert f"the GPU queues are {', '.join(GPU_QUEUES)}" in unknown.output
    too_many = sdq("worker", "gpu", "--gpus", "0,1", "--train-ranks", "3")
    assert too_many.exit_code == 2 and "--train-ranks 3: there are 2 GPUs" in too_many.output


def test_gpus_that_torch_cannot_see_are_refused_instead_of_run_on_the_cpu(sdq, tmp_path) -> None:
    named = sdq("worker", "gpu", "--gpus", "0,2")
    assert named.exit_code == 2
    assert "--gpus names GPUs 0,2 but torch" in named.output and "sees 0 of them" in named.output
    # A machine whose driver lists two GPUs, beside this CPU build of torch.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    smi.chmod(0o755)
    listed = sdq("worker", "gpu", env={"PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert listed.exit_code == 2 and "nvidia-smi lists GPUs 0,1 but torch" in listed.output


def test_sigterm_to_the_launcher_stops_every_worker(service_env, tmp_path) -> None:
    # A host name of its own: the session's worker may be alive under the usual one.
    process = WorkerProcess(service_env, tmp_path / "worker.log", host="stopping").start()
    group = process.process.pid
    assert len(process.children()) >= 3  # launcher, celery main, its pool process
    os.kill(process.process.pid, signal.SIGTERM)
    assert process.process.wait(60) == 0
    leftover = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
    assert leftover.stdout.split() == []


@pytest.mark.slow
def test_a_dead_worker_is_started_again_and_its_siblings_keep_working(
    service_env, tmp_path
) -> None:
    # A broker database of its own on the session's Redis.
    env = {**service_env, "SDQ_BROKER_URL": service_env["SDQ_BROKER_URL"].rsplit("/", 1)[0] + "/7"}
    log = tmp_path / "launcher.log"
    # Without GPUs, a train worker and a renderer: two workers under one launcher.
    launcher = subprocess.Popen(
        [sys.executable, "-m", "sdq.producer.cli", "worker", "gpu", "--train-ranks", "1"],
        env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip

    def workers() -> list[int]:
        listed = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
        return sorted(int(pid) for pid in listed.stdout.split())

    try:
        wait_for(lambda: log.read_text().count("ready.") == 2, what="two workers", timeout=180)
        first, second = workers()
        os.kill(first, signal.SIGKILL)  # one of the workers dies
        wait_for(lambda: log.read_text().count("ready.") == 3, what="a restart", timeout=180)
        said = (
            r"(train|cpu-render)@%h: killed by SIGKILL, perhaps out of memory; "
            r"starting it again in 2 s"
        )
        assert re.search(said, log.read_text())
        survivors = workers()
        assert second in survivors and first not in survivors and len(survivors) == 2
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        assert launcher.wait(60) == 0
    leftover = subprocess.run(["pgrep", "-g", str(launcher.pid)], capture_output=True, text=True)
    assert leftover.stdout.split() == []


def test_a_worker_that_keeps_dying_is_started_again_for_ever_and_said_why(capsys) -> None:
    """Past the fifth death in a row too: the delays double up to the cap and stay there."""
    script = "print('starting'); print('ValueError: no GPU at index 7', flush=True); exit(3)"
    command = WorkerCommand([sys.executable, "-c", script, "--hostname", "gpu7@%h"], {})
    # Each process lives a fraction of a second: none counts as having run well.
    worker = Supervised(command, first_delay=0.01, cap=0.08, healthy_after=600)
    said = re.compile(r"gpu7@%h: exited with code 3 \(ValueError: no GPU at index 7\); "
                      r"starting it again in ([0-9.]+) s")  # fmt: skip
    delays: list[str] = []
    while len(delays) < 8:
        worker.check()
        delays += said.findall(capsys.readouterr().err)
        time.sleep(0.005)
    assert delays == ["0.01", "0.02", "0.04", "0.08", "0.08", "0.08", "0.08", "0.08"]


@pytest.mark.parametrize(
    "launch", [("--train-ranks", "1"), ("taskset", "--cpu-list", "0")], ids=["ranks", "one-core"]
)
def test_a_train_worker_refuses_a_job_of_more_ranks_than_it_was_started_with(
    own_deployment: dict[str, str], tmp_path, launch: tuple[str, ...]
) -> None:
    """`--train-ranks 1` without GPUs, or a plain worker without GPUs that may use one core:
    a job of two ranks a node is dead at once, saying which worker can take it; no rank is
    started."""
    from sdq.models.db import make_engine, session_factory
    from sdq.models.jobs.kinds import TRAIN
    from sdq.models.tables import Job, JobStatus
    from tests.test_jobs import new_run
    from tests.test_train_rhythm import tiny_run

    sessions = session_factory(make_engine(own_deployment["SDQ_DATABASE_URL"]))
    spec = tiny_run(tmp_path)
    two_ranks = replace(spec, options=replace(spec.options, world_size=2))
    [job_id] = new_run(sessions, two_ranks.to_dict(), status=JobStatus.queued, kind=TRAIN)
    log = tmp_path / "launcher.log"
    command = [sys.executable, "-m", "sdq.producer.cli", "worker", "gpu", "--queues", "train"]
    if launch[0] == "taskset":
        command = [*launch, *command]
    else:
        command += launch
    launcher = subprocess.Popen(
        command,
        env=own_deployment, stdout=log.open("ab"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: "ready." in log.read_text(), what="the train worker", timeout=180)
        subprocess.run(
            [sys.executable, "-m", "sdq.producer.cli", "resume", "1"],
            env=own_deployment, check=True, capture_output=True,
        )  # fmt: skip

        def refused() -> bool:
            with sessions() as session:
                return session.get_one(Job, job_id).status == JobStatus.dead

        wait_for(refused, what="the job refused", timeout=90)
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(60)
    with sessions() as session:
        job = session.get_one(Job, job_id)
    assert job.attempts == 1
    assert "train run 1 trains on 2 ranks a node; this worker takes 1 at most" in job.error
    assert "`sdq worker gpu --train-ranks 2` starts one that can take it" in job.error
    assert "rank_start" not in log.read_text()


def test_a_second_worker_of_a_name_already_alive_refuses_to_start(
    own_deployment: dict[str, str], tmp_path
) -> None:
    """Two `sdq worker gpu` on one host would both be cpu-render@HOST (train@HOST with
    --train-ranks), and workers are called by name (a gang calls its members so): the second
    stops at once, says why, and its launcher does not start it again."""
    first = WorkerProcess(own_deployment, tmp_path / "first.log").start()
    try:
        second = run_sdq(own_deployment, "worker", "gpu", "--loglevel", "info", timeout=120)
        assert second.returncode == 78, second.stderr[-2000:]
        assert "already alive" in second.stderr and "not started again" in second.stderr
        assert first.ready() and first.process.poll() is None  # the first works on
    finally:
        first.stop()


def test_a_process_whose_store_is_not_the_deployment_s_is_refused_at_start(
    own_deployment: dict[str, str],
) -> None:
    """`sdq db upgrade` records the deployment's store. A worker started without
    SDQ_STORE_URL (it would write to a folder of its own) or with another one, and a submit
    with another one, would record outputs where nobody else reads them, served from cache
    ever after: each is refused at start, naming the deployment's store, and nothing is
    queued. So is a worker whose database it cannot reach, before it takes any message."""
    env = own_deployment
    assert run_sdq(env, "db", "upgrade").returncode == 0
    deployment = f"s3://{BUCKET}/deployment/"
    own_folder = {name: value for name, value in env.items() if name != "SDQ_STORE_URL"}
    elsewhere = {**env, "SDQ_STORE_URL": f"s3://{BUCKET}/elsewhere"}
    for other, command in [
        (own_folder, ["worker", "gpu"]),
        (elsewhere, ["worker", "cpu"]),
        (elsewhere, ["submit", str(ROOT / "examples" / "subjects.csv")]),
    ]:
        refused = run_sdq(other, *command, timeout=120)
        said = " ".join(refused.stderr.split())
        assert refused.returncode == 1, (command, refused.stderr[-2000:])
        assert f"this deployment's outputs are in {deployment} (as `sdq db upgrade`" in said
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        assert connection.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    no_database = {**env, "SDQ_DATABASE_URL": f"{env['SDQ_DATABASE_URL']}_never_made"}
    refused = run_sdq(no_database, "worker", "gpu", timeout=120)
    said = " ".join(refused.stderr.split())
    assert refused.returncode == 1 and "cannot connect to the database" in said, said
    # `sdq db upgrade` from a shell with another store moves nothing unless told to; told,
    # the other store is the deployment's.
    kept = run_sdq(elsewhere, "db", "upgrade")
    said = " ".join(kept.stderr.split())
    assert kept.returncode == 1 and f"outputs are in {deployment} (as" in said, said
    assert run_sdq(elsewhere, "db", "upgrade", "--move-store").returncode == 0
    moved = run_sdq(env, "submit", str(ROOT / "examples" / "subjects.csv"))
    assert moved.returncode == 1 and f"s3://{BUCKET}/elsewhere/ (as" in moved.stderr
    assert run_sdq(elsewhere, "submit", str(ROOT / "examples" / "subjects.csv")).returncode == 0
