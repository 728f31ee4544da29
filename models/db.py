"""Engines and sessions; nothing connects until first use."""

import io
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, TypeVar

import orjson
from psycopg import Cursor
from psycopg.copy import Copy, FileWriter
from psycopg.types.json import Jsonb
from sqlalchemy import (
    JSON,
    ColumnElement,
    Engine,
    Table,
    any_,
    create_engine,
    event,
    func,
    insert,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import Pool
from sqlalchemy.types import Enum as SqlEnum
from sqlalchemy.types import TypeEngine

# Ids or hashes per IN list: under SQLite's and psycopg's limits on bound parameters.
IN_LIST_LIMIT = 10_000
T = TypeVar("T")


def make_engine(
    database_url: str,
    *,
    create: bool = True,
    poolclass: type[Pool] | None = None,
    connect_timeout: int | None = None,
) -> Engine:
    """An engine for the URL. An SQLite file is made on first connection, unless not
    `create`: a command that only reads finds none rather than making an empty one. A
    `poolclass` (NullPool: a connection per use, closed after) and a `connect_timeout` in
    seconds (Postgres) are for a process that must not hold or wait on connections."""
    url = make_url(database_url)
    if url.drivername in ("postgresql", "postgres"):  # postgres://, as many hosts write it
        url = url.set(drivername="postgresql+psycopg")
    pooling = {"poolclass": poolclass} if poolclass else {}
    if url.get_backend_name() != "sqlite":
        connecting = {"connect_timeout": connect_timeout} if connect_timeout else {}
        return create_engine(url, pool_pre_ping=True, connect_args=connecting, **pooling)
    if url.database and url.database != ":memory:":
        if create:
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        else:
            path = Path(url.database).absolute().as_posix()
            url = url.set(database=f"file:{path}", query={"mode": "rw", "uri": "true"})
    engine = create_engine(url, connect_args={"timeout": 30}, **pooling)
    event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def bound_waits(session: Session, seconds: int) -> None:
    """No statement of the session's transaction waits longer than `seconds`, for a lock
    or otherwise (Postgres; SQLite's own busy timeout bounds its waits)."""
    if session.get_bind().dialect.name == "postgresql":
        milliseconds = seconds * 1000
        session.execute(text(f"SET LOCAL lock_timeout = {milliseconds}"))
        session.execute(text(f"SET LOCAL statement_timeout = {milliseconds}"))


def in_index_order(session: Session) -> None:
    """The session's transaction reads pages in the order of an index, not by sorting what
    a filter found (Postgres). Right after a run is written its rows have no statistics:
    the planner guesses a few hundred, and would sort every row still to come for each page,
    a cost that grows with the square of the run's size."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL enable_sort = off"))


def sqlite_file(database_url: str) -> Path | None:
    """The SQLite file the URL names; None for another database or one in memory."""
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


def missing_sqlite(database_url: str) -> Path | None:
    """The SQLite file the URL names, when there is none."""
    path = sqlite_file(database_url)
    return None if path is None or path.exists() else path


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets `sdq status` read while a worker writes; foreign keys are off by default.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def upsert(session: Session, table: Any) -> Any:
    """The backend's INSERT, which has ON CONFLICT (Postgres and SQLite spell it alike).
    Rows go as the execute's parameters, not in `.values(rows)`: the statement is then
    compiled once and cached, where `.values` compiles anew for each call (a curate
    shard's 256 score rows: 62 ms to record against 17 ms)."""
    dialect = session.get_bind().dialect.name
    return (postgresql.insert if dialect == "postgresql" else sqlite.insert)(table)


def finite_or_null(value: float | None) -> float | None:
    """A number as both databases can hold it: NaN and infinities (a diverged model's loss
    or scores) as NULL. SQLite refuses NaN, and Postgres's NaN sorts above every number."""
    return value if value is not None and math.isfinite(value) else None


def chunked(values: Iterable[T], size: int = IN_LIST_LIMIT) -> Iterator[list[T]]:
    """Lists of at most `size` values, in order (by default: one IN list each)."""
    iterator = iter(values)
    while chunk := list(islice(iterator, size)):
        yield chunk


def among_digests(
    session: Session, column: ColumnElement[Any], digests: list[str]
) -> ColumnElement[bool]:
    """`column IN digests`, for up to IN_LIST_LIMIT hex digests. On Postgres they go as one
    comma-joined text that the server splits (a digest holds no comma): binding 10,000
    parameters, or an array of 10,000, cost a 100k-job submit half a second and more."""
    if session.get_bind().dialect.name == "postgresql":
        return column == any_(func.string_to_array(",".join(digests), ","))
    return column.in_(digests)


def insert_rows(session: Session, table: Table, rows: list[dict[str, Any]]) -> list[int]:
    """Inserts rows and returns their new ids, in order.

    On Postgres the ids are drawn from the table's sequence first and the rows go in with
    COPY: a 100k-job submit spends seconds here instead of most of a minute. Elsewhere
    (SQLite, embedded) a plain multi-row INSERT ... RETURNING does it.
    """
    if not rows:
        return []
    if session.get_bind().dialect.name != "postgresql":
        statement = insert(table).returning(table.c.id, sort_by_parameter_order=True)
        return list(session.execute(statement, rows).scalars())
    ids, formatted = drawn_rows(session, table, rows)
    copy_in(session, formatted)
    return ids


def drawn_rows(
    session: Session, table: Table, rows: list[dict[str, Any]]
) -> tuple[list[int], "CopyText"]:
    """insert_rows' first step on Postgres, which writes nothing: the rows' ids drawn, and
    the rows with them formatted as COPY's text (copy_in sends it)."""
    ids = draw_ids(session, table, len(rows))
    numbered = [{"id": row_id, **row} for row_id, row in zip(ids, rows, strict=True)]
    return ids, copy_text(session, table, numbered)


def draw_ids(session: Session, table: Table, count: int) -> list[int]:
    """Ids for rows about to be inserted, drawn from the table's sequence (Postgres). A
    sequence is not transactional: any session may draw them for the writer's, and the ids
    of rows a rollback takes back are left unused. sdq's sequences cache no values, so a
    later draw's ids are above an earlier one's, whichever connections drew them."""
    statement = "SELECT nextval(pg_get_serial_sequence(:table, 'id')) FROM generate_series(1, :n)"
    return list(session.scalars(text(statement), {"table": table.name, "n": count}))


def copy_rows(session: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """Inserts rows whose keys are all given: COPY on Postgres, executemany elsewhere."""
    if not rows:
        return
    if session.get_bind().dialect.name != "postgresql":
        session.execute(insert(table), rows)
        return
    copy_in(session, copy_text(session, table, rows))


@dataclass(frozen=True)
class CopyText:
    """Rows as COPY FROM takes them (Postgres), formatted and not yet sent."""

    table: Table
    columns: list[str]
    data: bytes


def copy_text(session: Session, table: Table, rows: list[dict[str, Any]]) -> CopyText:
    """The rows (keys all given) as COPY's text, formatted by psycopg with the session's
    adapters and sent nowhere yet: formatted on one thread, they are copied in by another
    (copy_in), whose transaction may be another session's."""
    data = io.BytesIO()
    columns = list(rows[0]) if rows else []
    with Copy(_cursor(session), writer=FileWriter(data)) as copy:
        for values in _copy_values(table, columns, rows):
            copy.write_row(values)
    return CopyText(table, columns, data.getvalue())


def copy_in(session: Session, formatted: CopyText) -> None:
    """Inserts rows formatted by copy_text, as one COPY."""
    if formatted.data:
        with _cursor(session).copy(_copy_statement(formatted.table, formatted.columns)) as copy:
            # A view: psycopg sends a large buffer in slices, and slices of it copy nothing.
            copy.write(memoryview(formatted.data))


def _cursor(session: Session) -> Cursor:
    return session.connection().connection.dbapi_connection.cursor()


def _copy_statement(table: Table, columns: list[str]) -> str:
    return f"COPY {table.name} ({', '.join(columns)}) FROM STDIN"


def _copy_values(
    table: Table, columns: list[str], rows: list[dict[str, Any]]
) -> Iterator[list[Any]]:
    """Each row's values in the columns' order, as COPY takes them."""
    # Only JSON and enum columns need converting: looked up once, not per value (a 100k-job
    # submit copies over a million values).
    converted = [
        (position, convert)
        for position, name in enumerate(columns)
        if (convert := _copy_converter(table.c[name].type))
    ]
    for row in rows:
        values = [row[name] for name in columns]
        for position, convert in converted:
            values[position] = convert(values[position])
        yield values


def _copy_converter(column_type: TypeEngine[Any]) -> Callable[[Any], Any] | None:
    """How COPY needs a column's values given, or None where it takes them as they are."""
    if isinstance(column_type, JSON):
        # orjson: a submit's 100,000 specs in a tenth of the time the json module takes.
        return partial(Jsonb, dumps=orjson.dumps)
    if isinstance(column_type, SqlEnum):
        return lambda value: value.value if isinstance(value, Enum) else value
    return None
