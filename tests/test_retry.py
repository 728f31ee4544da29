"""`sdq retry RUN`: dead, failed or cancelled jobs start afresh and are done, with the
history saying who asked."""

from pathlib import Path

import psycopg
import pytest

from tests.conftest import WorkerProcess, sdq_json, wait_for_run, write

pytestmark = pytest.mark.timeout(300)


def test_cancelled_jobs_are_retried_and_done(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    env = own_deployment
    database_url = env["SDQ_DATABASE_URL"]
    prompts = write(tmp_path / "p.csv", "prompt,seed\nretried owl,1\nretried fox,2\n")
    run_id = sdq_json(env, "submit", str(prompts), "--steps", "2")["run_id"]
    assert sdq_json(env, "cancel", str(run_id)) == {"run_id": run_id, "cancelled": 2, "running": 0}
    # Nothing to do for statuses that have no jobs.
    assert sdq_json(env, "retry", str(run_id), "--status", "dead")["retried"] == 0
    assert sdq_json(env, "retry", str(run_id))["retried"] == 2

    worker = WorkerProcess(env, tmp_path / "gpu.log").start()
    try:
        assert wait_for_run(database_url, run_id, timeout=120) == {"succeeded": 2}
    finally:
        worker.stop()
    with psycopg.connect(database_url) as connection:
        jobs = connection.execute(
            "SELECT status, attempts FROM jobs WHERE run_id = %s", (run_id,)
        ).fetchall()
        asked = connection.execute(
            "SELECT count(*) FROM job_events e JOIN jobs j ON j.id = e.job_id "
            "WHERE j.run_id = %s AND e.detail LIKE 'retry asked by %%@%%'",
            (run_id,),
        ).fetchone()[0]
    assert jobs == [("succeeded", 1), ("succeeded", 1)]
    assert asked == 2
