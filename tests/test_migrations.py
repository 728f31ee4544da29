"""The schema comes from migrations, matches the models, and goes down and up again."""

from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import inspect, text

from migrations import downgrade, is_current, run_command, upgrade
from models.db import make_engine


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
            text("SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_jobs_prompt_trgm'")
        )
        assert "gin" in definition and "gin_trgm_ops" in definition
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        plan = connection.execute(
            text("EXPLAIN SELECT id FROM jobs WHERE prompt ILIKE '%castle%'")
        ).scalars()
        assert "ix_jobs_prompt_trgm" in "\n".join(plan)
