"""What SQLite needs of a migration that Postgres does not."""

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op


@contextmanager
def views_set_aside(table: str) -> Iterator[None]:
    """SQLite changes a table's constraints only by rebuilding the table, which fails while
    a view reads it: the views that read `table` are dropped meanwhile and made again as
    SQLite keeps them. Elsewhere a table is altered in place: nothing to do."""
    if op.get_bind().dialect.name != "sqlite":
        yield
        return
    views = (
        op.get_bind()
        .execute(
            sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'view' AND sql LIKE :table"),
            {"table": f"%{table}%"},
        )
        .all()
    )
    for name, _ in views:
        op.execute(f"DROP VIEW {name}")
    yield
    for _, definition in views:
        op.execute(definition)


@contextmanager
def rows_kept(table: str) -> Iterator[None]:
    """SQLite rebuilds a table by dropping it, and with foreign keys on, dropping deletes
    its rows first, which cascades into every table whose rows reference them: the rows of
    `table` (such a referencing table) are copied aside and put back once the rebuilt
    table, whose ids the rebuild keeps, is in place. Elsewhere nothing is dropped."""
    if op.get_bind().dialect.name != "sqlite":
        yield
        return
    op.execute(f"CREATE TEMP TABLE kept_{table} AS SELECT * FROM {table}")
    yield
    op.execute(f"DELETE FROM {table}")
    op.execute(f"INSERT INTO {table} SELECT * FROM kept_{table}")
    op.execute(f"DROP TABLE kept_{table}")
