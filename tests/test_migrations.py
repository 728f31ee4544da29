"""The schema comes from migrations, matches the models, goes down and up again, and its
indexes serve the lookups, scrapes and rollups that would otherwise read every row."""

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Connection, Engine, Select, inspect, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from sdq.migrations import downgrade, is_current, run_command, upgrade
from sdq.models.db import make_engine
from sdq.models.rollups import failures_by_hour, successes_by_hour
from sdq.producer.lookups import spec_hashes_starting
from sdq.producer.metrics import (
    SETBACK_COUNTERS,
    events_by_kind,
    jobs_by_kind_and_status,
    made_since,
)
from tests.services import scratch_database, wait_for


@pytest.fixture(params=["postgres", "sqlite"])
def empty_database(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sdq.db'}"
    return request.getfixturevalue("postgres_url")


def test_models_and_migrations_agree_and_round_trip(empty_database: str) -> None:
    engine = make_engine(empty_database)
    downgrade(engine, "base")  # the session database may already be migrated
    assert not is_current(engine)
    upgrade(engine)
    assert is_current(engine)
    run_command(engine, command.check)  # raises if autogenerate would find any difference
    downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert {"runs", "jobs", "job_events", "models"} <= set(inspect(engine).get_table_names())


def test_prompt_search_uses_the_trigram_index(migrated_postgres: str) -> None:
    engine = make_engine(migrated_postgres)
    with engine.begin() as connection:
        definition = connection.scalar(
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_generations_prompt_trgm'")
        )
        assert "gin" in definition and "gin_trgm_ops" in definition
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        plan = connection.execute(
            text("EXPLAIN SELECT job_id FROM generations WHERE prompt ILIKE '%castle%'")
        ).scalars()
        assert "ix_generations_prompt_trgm" in "\n".join(plan)


def test_a_spec_hash_prefix_is_a_range_of_its_index(migrated_postgres: str) -> None:
    # `sdq show 3fa9c1`: under a language's collation, Postgres read the whole index instead.
    with make_engine(migrated_postgres).begin() as connection:
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        plan = explain(connection, spec_hashes_starting("3fa9c1", limit=2))
    assert "ix_jobs_spec_hash_status" in plan
    assert "Index Cond: ((spec_hash >= '3fa9c1'::text) AND (spec_hash < '3fa9c2'::text))" in plan


def test_metrics_and_rollups_read_indexes_not_every_job_and_event(migrated_postgres: str) -> None:
    # At millions of jobs a scrape or a beat tick that reads every row takes seconds.
    since = datetime(2026, 11, 23, tzinfo=UTC)
    with make_engine(migrated_postgres).begin() as connection:
        session = Session(connection)
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        for _, which in SETBACK_COUNTERS.values():
            assert "ix_job_events_setbacks" in explain(connection, events_by_kind(which))
        assert "ix_job_events_setbacks" in explain(connection, failures_by_hour(session, since))
        # An index-only scan: the index holds every column the count needs.
        connection.execute(text("SET LOCAL enable_bitmapscan = off"))
        assert "Index Only Scan using ix_jobs_run_id_status" in explain(
            connection, jobs_by_kind_and_status()
        )


def test_the_finished_jobs_index_serves_the_recent_hours(migrated_postgres: str) -> None:
    # It holds finished jobs only (a submit's jobs go in as they finish); a month of them
    # is in the table, rolled back after, and an hour's worth is read from the index.
    with make_engine(migrated_postgres).connect() as connection, connection.begin() as work:
        connection.execute(text(FINISHED_JOBS))
        connection.execute(text("ANALYZE jobs"))
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        since = datetime.now(UTC) - timedelta(hours=1)
        for statement in successes_by_hour(Session(connection), since), made_since(since):
            assert "ix_jobs_finished_at" in explain(connection, statement)
        work.rollback()


FINISHED_JOBS = """
WITH run AS (
    INSERT INTO runs (kind, options, job_count) VALUES ('generate', '{}', 3000) RETURNING id
)
INSERT INTO jobs (run_id, kind, spec, spec_hash, status, attempts, cached, finished_at, units)
SELECT run.id, 'generate', '{}', md5(n::text) || md5(n::text),
       CASE WHEN n % 100 = 0 THEN 'queued' ELSE 'succeeded' END, 1, false,
       CASE WHEN n % 100 <> 0 THEN now() - n * interval '15 minutes' END, 1
FROM run, generate_series(1, 3000) AS n
"""


def test_a_samples_latest_score_is_read_off_an_index_whatever_the_statistics(
    migrated_postgres: str,
) -> None:
    # A dataset's scores deleted and written again: the planner's statistics saw the table
    # empty. Without (sample_id, id), each sample's max(id) was read off the
    # primary key backwards, filtering every row: seconds for a few thousand samples.
    with make_engine(migrated_postgres).connect() as connection, connection.begin() as work:
        connection.execute(text(CURATED_SAMPLES))
        connection.execute(text(SCORED))
        connection.execute(text("DELETE FROM sample_scores"))
        connection.execute(text("ANALYZE samples, sample_scores"))
        connection.execute(text(SCORED))
        plan = "\n".join(connection.execute(text(
            "EXPLAIN SELECT avg(clip_score) FROM sample_quality WHERE dataset = 'scored'"
        )).scalars())  # fmt: skip
        assert "Backward using ix_sample_scores_sample_id_id" in plan
        assert "Index Cond: ((sample_id = COALESCE(s.origin_id, s.id))" in plan
        work.rollback()


CURATED_SAMPLES = """
WITH dataset AS (INSERT INTO datasets (name, options) VALUES ('scored', '{}') RETURNING id),
shard AS (
    INSERT INTO shards (dataset_id, number, source_uri, source_id, first_row, row_count)
    SELECT id, 0, 'list.parquet', 'list', 0, 2000 FROM dataset RETURNING id, dataset_id
)
INSERT INTO samples (dataset_id, shard_id, key, url, status)
SELECT shard.dataset_id, shard.id, lpad(n::text, 9, '0'), 'https://example.com/' || n, 'success'
FROM shard, generate_series(1, 2000) AS n
"""
SCORED = """
INSERT INTO sample_scores
    (sample_id, dataset_id, model_revision, scorer, clip_score, scored_at)
SELECT id, dataset_id, 'clip', 'scorer', 20, now() FROM samples
"""


def explain(connection: Connection, statement: Select[Any]) -> str:
    sql = statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True})
    return "\n".join(connection.execute(text(f"EXPLAIN {sql}")).scalars())


FIRST_SCHEMA_ROWS = [
    "INSERT INTO runs (id, kind, source, options, job_count) "
    "VALUES (1, 'generate', 'p.csv', '{}', 1)",
    "INSERT INTO jobs (id, run_id, kind, spec, spec_hash, prompt, style, model, seed, source_line, "
    "batch_key, status, attempts, cached, render_seconds) VALUES (7, 1, 'generate', '{}', 'h', "
    "'a castle', 'ink', 'tiny', 42, 2, 'k', 'succeeded', 1, false, 0.5)",
    "INSERT INTO job_events (job_id, status) VALUES (7, 'pending'), (7, 'succeeded')",
]


def at_revision_with_rows(database_url: str, revision: str, rows: list[str]) -> Engine:
    """The database from scratch at `revision`, holding `rows`."""
    engine = make_engine(database_url)
    downgrade(engine, "base")
    upgrade(engine, revision)
    with engine.begin() as connection:
        for statement in rows:
            connection.execute(text(statement))
    return engine


def test_kind_neutral_jobs_keep_every_existing_row(empty_database: str) -> None:
    engine = at_revision_with_rows(empty_database, "0001", FIRST_SCHEMA_ROWS)
    upgrade(engine)
    with engine.begin() as connection:
        moved = connection.execute(
            text("SELECT prompt, style, model, seed, source_line, batch_key FROM generations")
        ).all()
        assert moved == [("a castle", "ink", "tiny", 42, 2, "k")]
        assert connection.scalar(text("SELECT work_seconds FROM jobs WHERE id = 7")) == 0.5
        # Rebuilding `jobs` would have cascaded into its history.
        assert connection.scalar(text("SELECT count(*) FROM job_events")) == 2
        assert connection.scalar(text("SELECT jobs_per_message FROM runs")) == 32
    downgrade(engine, "0001")
    with engine.begin() as connection:
        back = connection.execute(text("SELECT prompt, seed, render_seconds FROM jobs")).all()
        assert back == [("a castle", 42, 0.5)]
        assert connection.scalar(text("SELECT count(*) FROM job_events")) == 2
    downgrade(engine, "base")
    upgrade(engine)


TRAINED_ON_ROWS = [
    "INSERT INTO datasets (id, name, options) VALUES (1, 'pets', '{}')",
    "INSERT INTO shards (id, dataset_id, number, source_uri, source_id, first_row, row_count) "
    "VALUES (1, 1, 0, 'list.csv', 's', 0, 4)",
    "INSERT INTO latent_shards (id, dataset_id, shard_id, image_sha256, model_name, "
    "model_revision, resolution, uri, sha256, samples, tensors, seconds, finished_at) VALUES "
    "(5, 1, 1, 'i', 'tiny', 'r', 64, 'u', 's', 3, '{}', 1.0, '2026-11-27 00:00:00')",
    "INSERT INTO runs (id, kind, source, options, job_count) VALUES (2, 'train', 'pets', '{}', 1)",
    "INSERT INTO train_inputs (run_id, latent_shard_id) VALUES (2, 5)",
]


def test_latent_shards_gain_their_shape_and_keep_the_runs_that_read_them(
    empty_database: str,
) -> None:
    """0026 rebuilds latent_shards on SQLite, which with foreign keys on would cascade into
    train_inputs: a run's link to its data survives it both ways."""
    engine = at_revision_with_rows(empty_database, "0025", TRAINED_ON_ROWS)
    upgrade(engine)
    with engine.begin() as connection:
        shape = "SELECT width, height, bucketed FROM latent_shards"
        assert connection.execute(text(shape)).all() == [(64, 64, False)]
        assert connection.execute(text("SELECT * FROM train_inputs")).all() == [(2, 5)]
    downgrade(engine, "0025")
    with engine.begin() as connection:
        assert connection.execute(text("SELECT * FROM train_inputs")).all() == [(2, 5)]
    downgrade(engine, "base")
    upgrade(engine)


def test_a_run_trained_on_its_latent_shards_rows_less_those_it_held_out(
    empty_database: str,
) -> None:
    """A latent shard encoded before 0031 recorded no rows: it stands for its image shard's
    kept samples, as before. One whose rows are recorded is those samples, less the rows the
    run held out, and none once they are gone. Down again, the run keeps its inputs."""
    samples = ("INSERT INTO samples (id, dataset_id, shard_id, key, url, status) VALUES "
               "(1, 1, 1, 'a', 'u/a', 'success'), (2, 1, 1, 'b', 'u/b', 'success'), "
               "(3, 1, 1, 'c', 'u/c', 'failed')")  # fmt: skip
    engine = at_revision_with_rows(empty_database, "0025", [*TRAINED_ON_ROWS, samples])
    upgrade(engine)
    trained = "SELECT sample_id FROM train_samples WHERE run_id = 2 ORDER BY sample_id"
    with engine.begin() as connection:
        assert connection.scalars(text(trained)).all() == [1, 2]
        connection.execute(text("INSERT INTO latent_samples VALUES (5, 0, 2), (5, 1, 1)"))
        connection.execute(text("UPDATE latent_shards SET rows_recorded = TRUE"))
        assert connection.scalars(text(trained)).all() == [1, 2]
        connection.execute(text("INSERT INTO train_held_out VALUES (2, 5, 1)"))
        assert connection.scalars(text(trained)).all() == [2]
        connection.execute(text("DELETE FROM latent_samples"))  # its samples dropped
        assert connection.scalars(text(trained)).all() == []
    downgrade(engine, "0030")
    with engine.begin() as connection:
        assert connection.scalar(text("SELECT count(*) FROM image_sources")) == 0
        assert connection.execute(text("SELECT * FROM train_inputs")).all() == [(2, 5)]
    downgrade(engine, "base")  # its rows, ids given, gone from the session's database
    upgrade(engine)


def test_every_command_on_a_database_without_tables_says_to_upgrade(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from sdq.producer.cli.main import main
    from tests.services import clean_env, scratch_database

    with scratch_database("sdq_bare") as database_url:
        env = {**clean_env(), "SDQ_DATABASE_URL": database_url, "SDQ_HOME": str(tmp_path)}
        commands = [["runs"], ["status", "1"], ["show", "1"], ["find", "--prompt", "x"],
                    ["cancel", "1"], ["dataset", "list"], ["train", "status", "1"]]  # fmt: skip
        for command in commands:
            result = CliRunner().invoke(main, command, env=env)
            assert result.exit_code == 1, (command, result.output)
            assert "no sdq tables yet: run `sdq db upgrade`" in result.output, command
            assert "Traceback" not in result.output


def test_scores_and_losses_stored_as_not_finite_become_null(empty_database: str) -> None:
    """0027 and 0028: what a diverged checkpoint or run left before (NaN and infinities on
    Postgres, an infinity on SQLite, which refused NaN) becomes NULL, never a best step;
    finite values stay as they were."""
    not_finite = (
        ["'NaN'::float8", "'Infinity'::float8", "'-Infinity'::float8"]
        if empty_database.startswith("postgresql")
        else ["9e999", "-9e999"]
    )
    scores = [
        "INSERT INTO checkpoint_scores (job_id, run_id, step, model_name, model_revision, "
        f"spec_hash, metric, value, samples, scorers) VALUES (7, 2, {step}, 'm', 'r', 'h', "
        f"'metric{step}', {value}, 4, '{{}}')"
        for step, value in enumerate(["0.25", *not_finite])
    ]
    losses = [
        "INSERT INTO train_steps (run_id, step, loss, lr, samples_per_second) "
        f"VALUES (3, {step}, {value}, 0.001, 8)"
        for step, value in enumerate(["0.25", *not_finite])
    ]
    rows = [
        "INSERT INTO runs (id, kind, source, options, job_count) VALUES (2, 'evaluate', 's', "
        "'{}', 1)",
        "INSERT INTO runs (id, kind, source, options, job_count) VALUES (3, 'train', 's', '{}', 1)",
        *losses,
        "INSERT INTO jobs (id, run_id, kind, spec, spec_hash, status, attempts, cached, units) "
        "VALUES (7, 2, 'evaluate', '{}', 'h', 'succeeded', 1, false, 1)",
        *scores,
    ]
    engine = at_revision_with_rows(empty_database, "0026", rows)
    upgrade(engine)
    with engine.begin() as connection:
        values = connection.execute(text("SELECT value FROM checkpoint_scores ORDER BY step"))
        assert values.scalars().all() == [0.25] + [None] * len(not_finite)
        values = connection.execute(text("SELECT loss FROM train_steps ORDER BY step"))
        assert values.scalars().all() == [0.25] + [None] * len(not_finite)
    downgrade(engine, "base")
    upgrade(engine)


def test_the_jobs_index_is_built_while_the_last_release_s_workers_write_jobs() -> None:
    """0029 indexes jobs, the largest table, in a rolling upgrade: the last release's
    workers go on claiming and finishing jobs. A plain CREATE INDEX waits for the write in
    hand and makes every later write wait behind it until the build ends; built
    CONCURRENTLY, later writes go through while it waits."""
    with scratch_database("sdq_rolling") as url:
        engine = make_engine(url)
        upgrade(engine, "0028")
        with engine.connect() as in_hand, engine.connect() as later:
            in_hand.execute(text("UPDATE jobs SET status = status WHERE false"))  # its lock
            failed: list[BaseException] = []
            building = threading.Thread(target=_upgrading, args=(engine, "0029", failed))
            building.start()
            wait_for(lambda: waiting_on_a_lock(later, "CREATE INDEX"), what="the index build")
            # Not a time limit: a write queued behind a plain build would wait for ever.
            later.execute(text("SET lock_timeout = '10s'"))
            later.execute(text("UPDATE jobs SET status = status WHERE false"))
            later.commit()
            in_hand.commit()
            building.join(60)
        with engine.connect() as connection:
            valid = (
                "SELECT indisvalid FROM pg_index WHERE indexrelid = 'ix_jobs_run_id_id'::regclass"
            )
            assert connection.scalar(text(valid)) is True
        assert not building.is_alive()
        engine.dispose()


def _upgrading(engine: Engine, revision: str, failed: list[BaseException]) -> None:
    try:
        upgrade(engine, revision)
    except BaseException as error:  # seen by the test, not lost with the thread
        failed.append(error)
        raise


def waiting_on_a_lock(connection: Connection, statement: str) -> bool:
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE :statement"
    )
    waiting = connection.scalar(text(query), {"statement": f"%{statement}%"})
    connection.rollback()
    return waiting > 0
