"""`sdq health`: every part of a working deployment answers; a part that is down is named
and the command exits 1."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, BeatProcess, WorkerProcess, run_sdq
from tests.services import free_port, scratch_database, wait_for

pytestmark = pytest.mark.timeout(300)


def health(env: dict[str, str]) -> tuple[int, dict[str, dict]]:
    done = run_sdq(env, "health", "--json", cwd=ROOT, timeout=120)
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0)
    return done.returncode, {check["name"]: check for check in report["checks"]}


def test_a_whole_deployment_is_healthy(
    worker: WorkerProcess, cpu_worker: WorkerProcess, service_env: dict[str, str], tmp_path
) -> None:
    env = {**service_env, "SDQ_MAINTENANCE_INTERVAL_SECONDS": "1"}
    code, checks = health(env)
    assert code == 1 and not checks["beat"]["ok"] and "sdq beat" in checks["beat"]["detail"]
    beat = BeatProcess(env, tmp_path / "beat.log").start()
    try:
        wait_for(lambda: health(env)[0] == 0, what="every check to pass", timeout=60)
    finally:
        beat.stop()
    _, checks = health(env)
    assert "wrote, read and deleted a probe" in checks["store"]["detail"]
    assert "schema current" in checks["database"]["detail"]
    assert checks["workers: generate"]["detail"].startswith("cpu-render@")
    assert checks["workers: download"]["detail"].startswith("cpu@")


def test_parts_that_are_down_are_named(service_env: dict[str, str]) -> None:
    env = {
        **service_env,
        "SDQ_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        "SDQ_STORE_URL": "s3://no-such-bucket/sdq",
    }
    code, checks = health(env)
    assert code == 1
    assert checks["database"]["ok"]
    assert not checks["store"]["ok"] and "no-such-bucket" in checks["store"]["detail"]
    assert not checks["broker"]["ok"] and "refused" in checks["broker"]["detail"].lower()
    assert checks["workers: train"] == {
        "name": "workers: train", "ok": False, "detail": "not asked: no broker"
    }  # fmt: skip


def test_a_database_before_its_schema_says_what_to_do_once(service_env: dict[str, str]) -> None:
    """Before `sdq db upgrade`: the database's row says to run it; the rows read from its
    tables are not asked, instead of each printing the missing table's error."""
    with scratch_database("sdq_bare") as bare:
        code, checks = health({**service_env, "SDQ_DATABASE_URL": bare})
    assert code == 1
    assert "run `sdq db upgrade`" in checks["database"]["detail"]
    for name in ("devices", "beat"):
        assert checks[name] == {"name": name, "ok": False,
                                "detail": "not asked: the database is not ready"}  # fmt: skip


def test_a_database_that_cannot_be_reached_is_one_line_saying_why(
    service_env: dict[str, str], postgres_url: str
) -> None:
    """No such database, nothing listening, and a postgres:// URL: one line with what to
    do (each was a page of traceback), and the common scheme taken as Postgres."""
    server = postgres_url.rsplit("/", 1)[0]

    def said(url: str, *command: str) -> str:
        done = run_sdq({**service_env, "SDQ_DATABASE_URL": url}, *command, cwd=ROOT)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        [line] = done.stderr.strip().splitlines()
        return line

    missing = said(f"{server}/sdq_never_made", "db", "upgrade")
    assert 'database "sdq_never_made" does not exist' in missing and "createdb" in missing
    closed = f"postgresql://postgres@127.0.0.1:{free_port()}/sdq"
    assert "Connection refused" in said(closed, "runs")
    assert "Connection refused" in said(closed.replace("postgresql:", "postgres:"), "runs")


def test_a_worker_whose_device_keeps_failing_is_taken_out_of_rotation(
    own_deployment: dict[str, str], tmp_path
) -> None:
    """A GPU worker whose device runs out of memory on every call (tests/sick_device) fails
    both jobs of a run, alone, again and again: its failures give them back without
    spending attempts. A healthy worker then starts and does them, and the sick one gets no
    more jobs to fail: it still finds that two of its failed tasks' jobs were done elsewhere
    (it looks again after its last failure), takes no more jobs, and says why in its log,
    in `sdq health` and in the metrics, until cleared."""
    from sqlalchemy import select

    from sdq.models.db import make_engine, session_factory
    from sdq.models.settings import Settings
    from sdq.models.tables import Job, SickWorker
    from sdq.producer.metrics import SdqCollector
    from sdq.workers.app import create_app
    from tests.conftest import sdq_json, wait_for_run, write

    env = {
        **own_deployment,
        "SDQ_SICK_AFTER": "2",
        "SDQ_CALLS_PER_TASK": "1",
        "SDQ_RETRY_BACKOFF_MAX_SECONDS": "2",  # the given-back jobs come round quickly
    }
    sick_env = {
        **env,
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests" / "sick_device"), env.get("PYTHONPATH", "")]
        ),
        "SDQ_TEST_SICK_DEVICE": "1",
    }
    sick_log = tmp_path / "sick.log"
    # Its own host name (a UTS namespace): its node is cpu-render@sickbox, as on a machine.
    sick = subprocess.Popen(
        ["unshare", "-u", "sh", "-c", 'hostname sickbox && exec "$@"', "sh", sys.executable,
         "-m", "sdq.producer.cli", "worker", "gpu", "--loglevel", "info"],
        env=sick_env, stdout=sick_log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    healthy = WorkerProcess(env, tmp_path / "healthy.log")
    sessions = session_factory(make_engine(env["SDQ_DATABASE_URL"]))
    app = create_app(Settings.from_env(env))

    def tasks_failed_by_sickbox() -> set[str]:
        retried = re.findall(r"Task sdq\.generate\[([0-9a-f-]+)\] retry", sick_log.read_text())
        return set(retried)

    def consumed_by_sickbox() -> list[str]:
        answers = app.control.inspect(timeout=2).active_queues() or {}
        return [queue["name"] for queue in answers.get("cpu-render@sickbox", [])]

    try:
        wait_for(lambda: "ready." in sick_log.read_text(), what="the sick worker", timeout=180)
        listing = write(tmp_path / "p.csv", "prompt,seed\na sick device 1,1\na sick device 2,2\n")
        run_id = sdq_json(env, "submit", str(listing), "--steps", "2", "--batch-size", "1")[
            "run_id"
        ]
        wait_for(lambda: len(tasks_failed_by_sickbox()) == 2, what="both jobs failed", timeout=60)
        healthy.start()
        assert wait_for_run(env["SDQ_DATABASE_URL"], run_id) == {"succeeded": 2}
        wait_for(lambda: "sick, taking no more jobs from" in sick_log.read_text(),
                 what="the sick worker taken out", timeout=30)  # fmt: skip
        with sessions() as session:
            [taken_out] = session.scalars(select(SickWorker)).all()
            attempts = set(session.scalars(select(Job.attempts).where(Job.run_id == run_id)))
            workers = set(session.scalars(select(Job.worker_host).where(Job.run_id == run_id)))
        assert taken_out.worker == "cpu-render@sickbox" and "CUDA out of memory" in taken_out.reason
        assert attempts == {1}  # the sick device's failures spent none
        assert not any(worker.startswith("sickbox:") for worker in workers)
        wait_for(lambda: consumed_by_sickbox() == [], what="the sick worker to stop", timeout=30)
        code, checks = health(env)
        assert code == 1 and "cpu-render@sickbox out of rotation" in checks["devices"]["detail"]
        sick_gauge = [
            sample.labels["worker"]
            for family in SdqCollector(app).collect()
            for sample in family.samples
            if sample.name == "sdq_worker_sick"
        ]
        assert sick_gauge == ["cpu-render@sickbox"]

        cleared = sdq_json(env, "worker", "clear", "cpu-render@sickbox")
        assert "generate" in cleared["queues"]
        wait_for(lambda: "generate" in consumed_by_sickbox(), what="it back", timeout=30)
        assert health(env)[1]["devices"]["ok"]
    finally:
        os.killpg(sick.pid, 15)
        sick.wait(60)
        healthy.stop()


def test_a_worker_put_back_in_rotation_is_judged_afresh(own_deployment: dict[str, str]) -> None:
    """Taken out, a worker forgets the failures it was judged on: once `sdq worker clear`
    puts it back, one more failed task whose job another worker does is not SICK_AFTER of
    them (it was taken out again at once, on the old ones)."""
    from sqlalchemy import delete, select, update

    from sdq.models.settings import Settings
    from sdq.models.tables import Job, JobStatus, SickWorker
    from sdq.workers import sickness
    from sdq.workers.app import create_app
    from tests.test_jobs import new_run

    app = create_app(Settings.from_env({**own_deployment, "SDQ_SICK_AFTER": "2"}))
    first, second, third = new_run(app.sessions, *({"n": n} for n in range(3)))
    with app.sessions.begin() as session:
        session.execute(update(Job).values(status=JobStatus.succeeded, worker_host="other:1"))
    suspect = sickness.Suspect(app, "gpu@sickbox", "sickbox:7", ["generate"], "out of memory")

    def judged_after(task: str, job: int) -> list[str]:
        sickness._failed_in_a_row[task] = [job]  # as after_task records a failed task
        sickness.judge(suspect)
        with app.sessions() as session:
            return session.scalars(select(SickWorker.worker)).all()

    try:
        assert judged_after("task-1", first) == []
        assert judged_after("task-2", second) == ["gpu@sickbox"]
        with app.sessions.begin() as session:  # what `sdq worker clear` does to the record
            session.execute(delete(SickWorker))
        assert judged_after("task-3", third) == []
    finally:
        sickness._failed_in_a_row.clear()
