"""SQL on the history: the views, `sdq sql` (read-only, table, CSV, JSON), and every query
docs/sql.md offers, run against a real run on Postgres and embedded on SQLite."""

import csv
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_sdq, sdq_json, write
from tests.services import clean_env

# Its tests share a module-wide fixture: in one test process when run in parallel.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("test_history_sql")]


def readme_queries() -> list[tuple[str, str]]:
    """(question, query) for each query docs/sql.md offers."""
    section = (ROOT / "docs" / "sql.md").read_text()
    block = section.split("```sql", 1)[1].split("```", 1)[0]
    queries = []
    for chunk in block.split(";"):
        lines = chunk.strip().splitlines()
        if lines:
            queries.append((lines[0].removeprefix("-- "), "\n".join(lines[1:])))
    return queries


def sql(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run_sdq(env, "sql", *args, cwd=ROOT, timeout=120)


@pytest.fixture(scope="module")
def rendered_run(worker, service_env: dict[str, str], tmp_path_factory) -> dict:
    rows = "".join(f"sql lighthouse,{seed}\n" for seed in range(5)) + "sql harbour,9\n"
    prompts = write(tmp_path_factory.mktemp("sql") / "p.csv", "prompt,seed\n" + rows)
    return sdq_json(service_env, "submit", str(prompts), "--steps", "2", "--wait")


def test_the_views_describe_the_run(rendered_run: dict, service_env: dict[str, str]) -> None:
    run_id = rendered_run["run_id"]
    summary = sql(service_env, f"SELECT * FROM run_summary WHERE run_id = {run_id}", "--json")
    [row] = json.loads(summary.stdout)
    assert (row["jobs"], row["succeeded"], row["dead"], row["kind"]) == (6, 6, 0, "generate")
    assert float(row["seconds"]) > 0 and float(row["jobs_per_second"]) > 0
    history = sql(
        service_env,
        f"SELECT job_id, status, worker, queued_seconds, work_seconds FROM job_history "
        f"WHERE run_id = {run_id} ORDER BY job_id",
        "--csv",
    )
    rows = list(csv.DictReader(io.StringIO(history.stdout)))
    assert [row["status"] for row in rows] == ["succeeded"] * 6
    assert all(row["worker"] and float(row["queued_seconds"]) >= 0 for row in rows)


def test_sdq_sql_only_reads(rendered_run: dict, service_env: dict[str, str]) -> None:
    count = f"SELECT count(*) AS n FROM jobs WHERE run_id = {rendered_run['run_id']}"
    refused = sql(service_env, f"DELETE FROM jobs WHERE run_id = {rendered_run['run_id']}")
    assert refused.returncode == 2
    assert "sdq sql only reads" in refused.stderr
    assert json.loads(sql(service_env, count, "--json").stdout) == [{"n": 6}]
    broken = sql(service_env, "SELEC 1")
    assert broken.returncode == 2 and "syntax error" in broken.stderr
    table = sql(service_env, count)
    assert table.returncode == 0 and re.search(r"\b6\b", table.stdout)


def test_columns_come_as_the_database_returns_them(
    rendered_run: dict, service_env: dict[str, str]
) -> None:
    """Postgres names each unaliased aggregate after its function: `min, max, min`."""
    run_id = rendered_run["run_id"]
    ids = sorted(job["id"] for job in rendered_run["jobs"])
    aggregates = sql(service_env, f"SELECT min(id), max(id), min(run_id) FROM jobs "
                     f"WHERE run_id = {run_id}", "--csv")  # fmt: skip
    assert aggregates.stdout == f"min,max,min\n{ids[0]},{ids[-1]},{run_id}\n"
    check_rows_as_the_database_returns_them(service_env)


def check_rows_as_the_database_returns_them(env: dict[str, str]) -> None:
    """Two columns of one name both printed, in JSON the later one with a suffix that names
    no other column; two statements refused as such, by name, with no traceback."""
    twice = "SELECT 7 AS a, 8 AS a, 9 AS a_2"
    assert sql(env, twice, "--csv").stdout == "a,a,a_2\n7,8,9\n"
    assert json.loads(sql(env, twice, "--json").stdout) == [{"a": 7, "a_3": 8, "a_2": 9}]
    table = sql(env, twice).stdout
    assert "cut to fit" not in sql(env, twice).stderr
    wide = sql({**env, "COLUMNS": "80"}, "SELECT * FROM run_summary")
    assert wide.returncode == 0 and "name fewer columns, or give --csv or --json" in " ".join(
        wide.stderr.split()
    )
    assert re.search(r"\ba\b.*\ba\b.*\ba_2\b", table) and re.search(r"\b7\b.*\b8\b.*\b9\b", table)
    for query in ["SELECT 1; SELECT 2", "SELECT 1 AS x;\n SELECT * FROM jobs;"]:
        refused = sql(env, query)
        assert refused.returncode == 2 and "one statement at a time" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert json.loads(sql(env, "SELECT 1 AS one; -- a comment", "--json").stdout) == [{"one": 1}]


def test_every_readme_question_is_answered(rendered_run: dict, service_env: dict[str, str]) -> None:
    queries = readme_queries()
    assert len(queries) >= 6
    spec_hash = rendered_run["jobs"][0]["uri"].rsplit("/", 1)[1].removesuffix(".png")
    answers = {}
    for question, query in queries:
        result = sql(service_env, query.replace("3f2a...", spec_hash), "--json")
        assert result.returncode == 0, f"{question}\n{result.stderr}"
        answers[question] = json.loads(result.stdout)
    made_by = next(rows for question, rows in answers.items() if "seed made" in question)
    assert [row["output_uri"] for row in made_by] == [rendered_run["jobs"][0]["uri"]]
    most = next(rows for question, rows in answers.items() if "rendered most" in question)
    assert {"prompt": "sql lighthouse", "images": 5} in most


def test_the_dashboard_queries_read_the_rollups(
    rendered_run: dict, service_env: dict[str, str]
) -> None:
    """The Grafana dashboard's Postgres panels, run as Grafana would, once beat has rolled
    the run up (here: the rollup step itself, as beat's task calls it)."""
    from sdq.models.db import make_engine, session_factory
    from sdq.models.rollups import roll_up

    roll_up(session_factory(make_engine(service_env["SDQ_DATABASE_URL"])))
    dashboard = json.loads((ROOT / "ops/grafana/sdq.json").read_text())
    queries = [target["rawSql"] for panel in dashboard["panels"]
               for target in panel["targets"] if "rawSql" in target]  # fmt: skip
    assert queries
    for query in queries:
        result = sql(service_env, query, "--json")
        assert result.returncode == 0, f"{query}\n{result.stderr}"
        rows = json.loads(result.stdout)
        assert (
            sum(row["made"] for row in rows if row.get("kind", row.get("metric")) == "generate")
            >= 6
        )


def test_embedded_history_is_sql_too(tmp_path: Path) -> None:
    env = {**clean_env(), "SDQ_HOME": str(tmp_path / "home")}
    prompts = write(tmp_path / "p.csv", "prompt,seed\nembedded sql,1\n")
    run = sdq_json(env, "run", str(prompts), "--steps", "2")
    summary = sql(env, "SELECT run_id, succeeded FROM run_summary", "--json")
    assert json.loads(summary.stdout) == [{"run_id": run["run_id"], "succeeded": 1}]
    as_csv = subprocess.run(
        [sys.executable, "-m", "sdq.producer.cli", "sql", "--csv",
         "SELECT run_id, succeeded FROM run_summary"],
        env=env, cwd=ROOT, capture_output=True, timeout=120,
    )  # fmt: skip
    assert as_csv.stdout == f"run_id,succeeded\n{run['run_id']},1\n".encode()  # LF, as on POSIX
    refused = sql(env, "DROP TABLE jobs")
    assert refused.returncode == 2 and "sdq sql only reads" in refused.stderr
    check_rows_as_the_database_returns_them(env)
