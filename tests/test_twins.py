"""Equal specs submitted at once to several workers are made once: while one job makes a
spec, its twins wait for it and are served its output."""

import concurrent.futures
from pathlib import Path

import psycopg
import pytest

from tests.conftest import WorkerProcess, sdq_json, write
from tests.services import wait_for

pytestmark = pytest.mark.timeout(400)
SPECS = 24
SUBMITS = 5


def test_identical_submits_at_once_render_each_spec_once(
    own_deployment: dict[str, str], tmp_path: Path
) -> None:
    env = own_deployment
    rows = "".join(f"twins at once {n},{n}\n" for n in range(SPECS))
    prompts = write(tmp_path / "p.csv", "prompt,seed\n" + rows)
    # Two machines: two worker names (cpu-render@twin0, @twin1), as each would have.
    workers = [
        WorkerProcess(env, tmp_path / f"gpu-{n}.log", host=f"twin{n}").start() for n in range(2)
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(SUBMITS) as pool:
            submitted = list(
                pool.map(
                    lambda _: sdq_json(env, "submit", str(prompts), "--steps", "3"),
                    range(SUBMITS),
                )
            )
        run_ids = [run["run_id"] for run in submitted]

        def finished() -> bool:
            with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
                [open_runs] = connection.execute(
                    "SELECT count(*) FROM runs WHERE id = ANY(%s) AND finished_at IS NULL",
                    (run_ids,),
                ).fetchone()
            return open_runs == 0

        wait_for(finished, what="every run", timeout=300)
    finally:
        for worker in workers:
            worker.stop()
    with psycopg.connect(env["SDQ_DATABASE_URL"]) as connection:
        by_status = dict(
            connection.execute("SELECT status, count(*) FROM jobs GROUP BY status").fetchall()
        )
        [made] = connection.execute(
            "SELECT count(*) FROM jobs WHERE status = 'succeeded' AND NOT cached"
        ).fetchone()
        [workers_used] = connection.execute(
            "SELECT count(DISTINCT worker_host) FROM job_events WHERE status = 'running'"
        ).fetchone()
    assert by_status == {"succeeded": SPECS * SUBMITS}
    assert workers_used == 2  # both workers took jobs: the twins really met
    assert made == SPECS  # each spec rendered once; every other job was served
