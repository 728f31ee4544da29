"""Alembic migrations, applied from code so `sdq db upgrade` needs no alembic.ini."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent))
    # The ini parser reads % as its interpolation: a URL's own (%3A, a password's) doubled.
    url = engine.url.render_as_string(hide_password=False).replace("%", "%%")
    config.set_main_option("sqlalchemy.url", url)
    return config


def run_command(engine: Engine, action: Callable[..., Any], *args: Any) -> None:
    """Runs an Alembic command (upgrade, downgrade, check...) in one transaction on `engine`,
    which Alembic begins and commits (env.py): a migration's `autocommit_block` (an index
    built CONCURRENTLY) commits what came before it and runs outside."""
    with engine.connect() as connection:
        config = alembic_config(engine)
        config.attributes["connection"] = connection
        action(config, *args)


def upgrade(engine: Engine, revision: str = "head") -> None:
    run_command(engine, command.upgrade, revision)


def downgrade(engine: Engine, revision: str) -> None:
    run_command(engine, command.downgrade, revision)


def ready(engine: Engine) -> bool:
    """Whether the schema is current, after making it if the database is embedded SQLite
    (made and migrated on first use; a shared database is migrated on purpose)."""
    if engine.dialect.name == "sqlite":
        upgrade(engine)
    return is_current(engine)


def is_current(engine: Engine) -> bool:
    """Whether the database is at the newest migration."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    heads = set(ScriptDirectory.from_config(alembic_config(engine)).get_heads())
    with engine.connect() as connection:
        return set(MigrationContext.configure(connection).get_current_heads()) == heads
