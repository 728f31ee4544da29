"""Beat heals without anyone typing a command: messages the broker lost are sent again,
a worker killed with its whole pool has its jobs finished after the lease, jobs the broker
refused at submit are sent once it is back, and two beats at once do every job once."""

import json
import os
import signal
import subprocess
from collections import Counter
from pathlib import Path

import psycopg
import pytest
import redis

from sdq.models.generate.galleries import gallery_key
from sdq.models.jobs.maintenance import EXPIRED
from tests.conftest import (
    BUCKET,
    ROOT,
    BeatProcess,
    WorkerProcess,
    run_sdq,
    sdq_json,
    wait_for_run,
    write,
)
from tests.services import free_port, listening, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

# Beat every second; a queued job unclaimed for 3 s in an empty queue counts as lost.
HEALING = {"SDQ_MAINTENANCE_INTERVAL_SECONDS": "1", "SDQ_RELAY_AFTER_SECONDS": "3"}
RESENT = "sent again by the relay"


@pytest.fixture
def heal_env(own_deployment: dict[str, str]) -> dict[str, str]:
    return {**own_deployment, **HEALING}


def prompts(tmp_path: Path, count: int, label: str) -> Path:
    rows = "".join(f"{label} {n},{n}\n" for n in range(count))
    return write(tmp_path / f"{label.replace(' ', '-')}.csv", "prompt,seed\n" + rows)


def events(database_url: str, run_id: int) -> list[tuple[int, str, str | None]]:
    with psycopg.connect(database_url) as connection:
        return connection.execute(
            "SELECT e.job_id, e.status, e.detail FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE j.run_id = %s ORDER BY e.id",
            (run_id,),
        ).fetchall()


def started(*processes: WorkerProcess) -> list[WorkerProcess]:
    return [process.start() for process in processes]


def stop(processes: list[WorkerProcess]) -> None:
    for process in processes:
        process.stop()


def gallery_page(s3_client, run_id: int) -> str:
    """The run's gallery as the deployment's store (s3://BUCKET/deployment) holds it."""
    try:
        page = s3_client.get_object(Bucket=BUCKET, Key=f"deployment/{gallery_key(run_id)}")
    except s3_client.exceptions.NoSuchKey:
        return ""
    return page["Body"].read().decode()


def test_jobs_the_broker_lost_are_sent_again_by_two_beats_and_done_once(
    heal_env: dict[str, str], s3_client, tmp_path: Path
) -> None:
    database_url = heal_env["SDQ_DATABASE_URL"]
    run_id = sdq_json(heal_env, "submit", str(prompts(tmp_path, 200, "lost")), "--steps", "1")[
        "run_id"
    ]
    redis.Redis.from_url(heal_env["SDQ_BROKER_URL"]).flushdb()  # restarted empty: 200 lost

    processes = started(
        WorkerProcess(heal_env, tmp_path / "gpu.log"),
        WorkerProcess(heal_env, tmp_path / "cpu.log", pool="cpu"),
        BeatProcess(heal_env, tmp_path / "beat-1.log"),
        BeatProcess(heal_env, tmp_path / "beat-2.log"),
    )
    try:
        assert wait_for_run(database_url, run_id) == {"succeeded": 200}
        # The run finisher writes the finished run's gallery: nobody asked for it.
        wait_for(lambda: "lost 199" in gallery_page(s3_client, run_id),
                 what="the run's gallery", timeout=60)  # fmt: skip
    finally:
        stop(processes)
    history = events(database_url, run_id)
    resent = Counter(job for job, status, detail in history if detail == RESENT)
    claims = Counter(job for job, status, _ in history if status == "running")
    successes = Counter(job for job, status, _ in history if status == "succeeded")
    assert len(resent) == 200  # every job was sent again, by beat alone
    assert set(claims.values()) == {1} and set(successes.values()) == {1}  # each done once


def test_a_worker_killed_with_its_whole_pool_has_its_jobs_finished_after_the_lease(
    heal_env: dict[str, str], tmp_path: Path
) -> None:
    database_url = heal_env["SDQ_DATABASE_URL"]
    gpu = WorkerProcess(heal_env, tmp_path / "gpu.log").start()
    helpers = started(
        WorkerProcess(heal_env, tmp_path / "cpu.log", pool="cpu"),
        BeatProcess(heal_env, tmp_path / "beat.log"),
    )
    try:
        listing = prompts(tmp_path, 16, "killed pool")
        run_id = sdq_json(heal_env, "submit", str(listing), "--steps", "60")["run_id"]
        wait_for(
            lambda: any(status == "running" for _, status, _ in events(database_url, run_id)),
            what="a job to start",
            timeout=120,
        )
        os.killpg(gpu.process.pid, signal.SIGKILL)  # the parent and every child at once
        gpu.process.wait()
        gpu = WorkerProcess(heal_env, tmp_path / "gpu-2.log").start()
        assert wait_for_run(database_url, run_id) == {"succeeded": 16}
    finally:
        stop([gpu, *helpers])
    expired = {job for job, status, detail in events(database_url, run_id) if detail == EXPIRED}
    assert expired, "the killed worker's jobs came back through the lease sweep"


def test_a_worker_whose_clock_is_behind_keeps_its_leases_and_does_every_job_once(
    heal_env: dict[str, str], tmp_path: Path
) -> None:
    """Leases are set and judged by the database's clock: the leases a worker five minutes
    behind takes run their length for the sweep (beat, on a true clock) too, and no job is
    sent again. (Its Python processes read a skewed wall clock: tests/skewed_clock.)"""
    env = {**heal_env, "SDQ_LEASE_SECONDS": "6"}
    skewed_env = {
        **env,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "skewed_clock"), env.get("PYTHONPATH", "")]
        ),
        "SDQ_TEST_CLOCK_SKEW": "-300",
    }
    database_url = env["SDQ_DATABASE_URL"]
    processes = started(
        WorkerProcess(skewed_env, tmp_path / "gpu.log"),
        WorkerProcess(env, tmp_path / "cpu.log", pool="cpu"),
        BeatProcess(env, tmp_path / "beat.log"),
    )
    try:
        listing = prompts(tmp_path, 24, "skewed clock")
        run_id = sdq_json(env, "submit", str(listing), "--steps", "20")["run_id"]
        assert wait_for_run(database_url, run_id) == {"succeeded": 24}
    finally:
        stop(processes)
    history = events(database_url, run_id)
    assert not [job for job, _, detail in history if detail in (EXPIRED, RESENT)]
    claims = Counter(job for job, status, _ in history if status == "running")
    assert set(claims.values()) == {1}  # each job claimed once: done once
    with psycopg.connect(database_url) as connection:
        [behind] = connection.execute(
            "SELECT min(extract(epoch FROM r.created_at - e.at)) FROM job_events e "
            "JOIN jobs j ON j.id = e.job_id JOIN runs r ON r.id = j.run_id "
            "WHERE j.run_id = %s AND e.status = 'succeeded'",
            (run_id,),
        ).fetchone()
    assert behind > 200  # the worker stamped its successes by its own clock, minutes behind


def test_jobs_submitted_while_the_broker_is_down_are_sent_when_it_is_back(
    heal_env: dict[str, str], tmp_path: Path
) -> None:
    port = free_port()
    env = {**heal_env, "SDQ_BROKER_URL": f"redis://127.0.0.1:{port}/0"}
    database_url = env["SDQ_DATABASE_URL"]
    refused = run_sdq(env, "submit", str(prompts(tmp_path, 5, "no broker")), timeout=120)
    assert refused.returncode == 1, refused.stderr
    assert "saved as pending" in refused.stderr
    with psycopg.connect(database_url) as connection:
        [run_id] = connection.execute("SELECT max(id) FROM runs").fetchone()
    assert {status for _, status, _ in events(database_url, run_id)} >= {"pending"}

    subprocess.run(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no",
         "--daemonize", "yes"],
        check=True,
    )  # fmt: skip
    wait_for(lambda: listening(port), what="the broker to come back")
    processes: list[WorkerProcess] = []
    try:
        processes = started(
            WorkerProcess(env, tmp_path / "gpu.log"),
            WorkerProcess(env, tmp_path / "cpu.log", pool="cpu"),
            BeatProcess(env, tmp_path / "beat.log"),
        )
        assert wait_for_run(database_url, run_id) == {"succeeded": 5}
    finally:
        stop(processes)
        redis.Redis(port=port).shutdown(nosave=True)


def test_a_task_past_its_time_limit_fails_its_job_and_never_leaves_it_running(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """A render longer than the generate queue's limit (4 s: soft 3 s) is stopped, its job
    failed with the reason, tried again, and dead once its attempts are used up."""
    env = {**own_deployment, "SDQ_GENERATE_TASK_TIME_LIMIT": "4", "SDQ_MAX_ATTEMPTS": "2",
           "SDQ_RETRY_BACKOFF_SECONDS": "1"}  # fmt: skip
    database_url = env["SDQ_DATABASE_URL"]
    worker = WorkerProcess(env, tmp_path / "gpu.log").start()
    try:
        listing = prompts(tmp_path, 1, "too slow")
        # ~11 s on an idle machine (1000 steps at 64 px: ~3.4 s, a hair past the soft limit).
        run_id = sdq_json(env, "submit", str(listing), "--steps", "1000",
                          "--size", "256x256")["run_id"]  # fmt: skip
        assert wait_for_run(database_url, run_id) == {"dead": 1}
    finally:
        worker.stop()
    history = [(status, detail) for _, status, detail in events(database_url, run_id)]
    assert [status for status, _ in history].count("running") == 2  # both attempts ran
    assert history[-1][0] == "dead"
    with psycopg.connect(database_url) as connection:
        attempts, error = connection.execute(
            "SELECT attempts, error FROM jobs WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert attempts == 2 and "SoftTimeLimitExceeded" in error


def test_a_task_killed_at_its_hard_time_limit_has_its_attempt_recorded_at_once(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    """A pool process that does not hear the soft limit (tests/deaf_to_soft_limits: stuck
    in a C call) is killed at the hard one, 4 s. The worker's main process saw the kill: it
    records the attempt failed, with the reason, and sends the job again, instead of the
    job waiting, running, for its lease to run out and beat to notice (no beat runs here:
    before, the job stayed `running` for ever). Two attempts, then dead."""
    env = {**own_deployment, "SDQ_GENERATE_TASK_TIME_LIMIT": "4", "SDQ_MAX_ATTEMPTS": "2",
           "SDQ_RETRY_BACKOFF_SECONDS": "1", "SDQ_LEASE_SECONDS": "600",
           "SDQ_TEST_DEAF_TO_SOFT_LIMITS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "deaf_to_soft_limits"),
                                          own_deployment.get("PYTHONPATH", "")])}  # fmt: skip
    database_url = env["SDQ_DATABASE_URL"]
    worker = WorkerProcess(env, tmp_path / "gpu.log").start()
    try:
        listing = prompts(tmp_path, 1, "killed slow")
        # 1000 steps at 256 px: ~11 s on an idle machine, well past the limit (at the tiny
        # model's 64 px, ~3.4 s: under it, and the render ends before the kill).
        run_id = sdq_json(env, "submit", str(listing), "--steps", "1000",
                          "--size", "256x256")["run_id"]  # fmt: skip
        assert wait_for_run(database_url, run_id, timeout=90) == {"dead": 1}
    finally:
        worker.stop()
    history = [(status, detail) for _, status, detail in events(database_url, run_id)]
    assert [status for status, _ in history] == [
        "queued", "running", "failed", "running", "dead"
    ]  # fmt: skip
    assert all("killed at the hard time limit of 4 s" in detail for _, detail in history[2::2])


def queued_time_limits(broker_url: str, queue: str) -> list[list[int]]:
    """The time limits each message waiting on `queue` carries, as kombu stores them."""
    messages = redis.Redis.from_url(broker_url).lrange(queue, 0, -1)
    return [json.loads(message)["headers"]["timelimit"] for message in messages]


def test_no_message_carries_time_limits_whoever_sends_it(
    heal_env: dict[str, str], tmp_path: Path
) -> None:
    """A submit run with its own limits, and the relay inside a task on the CPU pool: the
    generate messages they send name no time limits, so the worker that takes them runs
    them under its own settings' (Celery obeys a message's limits over the worker's)."""
    env = {**heal_env, "SDQ_GENERATE_TASK_TIME_LIMIT": "777", "SDQ_CALLS_PER_TASK": "1"}
    broker = redis.Redis.from_url(env["SDQ_BROKER_URL"])
    sdq_json(env, "submit", str(prompts(tmp_path, 3, "limits")), "--batch-size", "1")
    submitted = queued_time_limits(env["SDQ_BROKER_URL"], "generate")
    assert submitted == [[None, None]] * 3
    broker.delete("generate")  # lost: only the relay can send them again

    processes = started(
        WorkerProcess(env, tmp_path / "cpu.log", pool="cpu"),
        BeatProcess(env, tmp_path / "beat.log"),
    )
    try:
        wait_for(lambda: broker.llen("generate") == 3, what="the relay to send the jobs again")
    finally:
        stop(processes)
    assert queued_time_limits(env["SDQ_BROKER_URL"], "generate") == submitted


def test_a_failed_job_whose_retry_waits_where_nobody_looks_is_sent_again_by_beat(
    heal_env: dict[str, str], tmp_path: Path
) -> None:
    """A job is failed, waiting for its retry, whose message was sent to a warm queue that
    no live worker consumes any more (its worker let go of what made it warm: a run's ranks
    failed, a pipeline was evicted), or lost with the broker: beat sends it again once its
    retry is overdue, and a worker does it, once."""
    database_url = heal_env["SDQ_DATABASE_URL"]
    run_id = sdq_json(heal_env, "submit", str(prompts(tmp_path, 3, "stranded")), "--steps", "1")[
        "run_id"
    ]
    broker = redis.Redis.from_url(heal_env["SDQ_BROKER_URL"])
    # The state a retry sent to the queue it came in on leaves: each job failed once, its
    # retry due now, its message in `generate.warm.gone`, which nobody consumes.
    stranded = 0
    while broker.lmove("generate", "generate.warm.gone"):
        stranded += 1
    with psycopg.connect(database_url) as connection:
        connection.execute(
            "UPDATE jobs SET status = 'failed', attempts = 1, error = 'RankFailed: a peer died', "
            "retry_at = now() WHERE run_id = %s",
            (run_id,),
        )
    processes = started(
        WorkerProcess(heal_env, tmp_path / "gpu.log"),
        WorkerProcess(heal_env, tmp_path / "cpu.log", pool="cpu"),
        BeatProcess(heal_env, tmp_path / "beat.log"),
    )
    try:
        assert wait_for_run(database_url, run_id, timeout=120) == {"succeeded": 3}
    finally:
        stop(processes)
    history = events(database_url, run_id)
    assert Counter(job for job, _, detail in history if detail == RESENT).total() == 3
    assert set(Counter(job for job, status, _ in history if status == "succeeded").values()) == {1}
    assert stranded and broker.llen("generate.warm.gone") == stranded  # nobody read them
