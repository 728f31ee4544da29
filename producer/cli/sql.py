"""`sdq sql`: questions about the history, asked in SQL, answered read-only."""

import csv
import sys

import click
from sqlalchemy import Connection, CursorResult, text
from sqlalchemy.exc import DBAPIError, StatementError

from sdq.producer import display
from sdq.producer.cli.common import InputError, ensure_schema, pass_app
from sdq.workers.app import SdqCelery


@click.command()
@click.argument("query")
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV instead of a table.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (a list of rows).")
@pass_app
def sql(app: SdqCelery, query: str, as_csv: bool, as_json: bool) -> None:
    """Run QUERY on the history (jobs, job_events, runs, job_history, run_summary, samples,
    shards, checkpoints, image_sources, train_samples...) in a read-only transaction: a
    statement that writes fails and nothing changes."""
    ensure_schema(app)
    with app.engine.connect() as connection:
        _read_only(connection)
        try:
            result = connection.execute(text(query))
        except (DBAPIError, StatementError) as error:
            raise InputError(_reason(error)) from None
        if not result.returns_rows:
            raise InputError("the statement returned no rows")
        if _more_statements(result):
            raise InputError(ONE_STATEMENT)
        columns = list(result.keys())
        rows = [tuple(row) for row in result]
        connection.rollback()
    _print(rows, columns, as_csv=as_csv, as_json=as_json)


ONE_STATEMENT = "sdq sql runs one statement at a time: the query holds more than one"


def _more_statements(result: CursorResult) -> bool:
    """Whether the query held statements after the first: psycopg runs them all and keeps
    their results behind the first's (SQLite refuses them at once, see _reason)."""
    nextset = getattr(result.cursor, "nextset", None)
    return nextset is not None and bool(nextset())


def _read_only(connection: Connection) -> None:
    """Postgres refuses writes in a read-only transaction; SQLite in query_only mode."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql("SET TRANSACTION READ ONLY")
    else:
        connection.exec_driver_sql("PRAGMA query_only = ON")


def _reason(error: DBAPIError | StatementError) -> str:
    message = str(error.orig or error).strip().splitlines()[0]
    if "one statement at a time" in message:
        return ONE_STATEMENT
    if "read-only" in message or "readonly" in message:
        return f"sdq sql only reads: {message}"
    return message


def _print(rows: list[tuple], columns: list[str], *, as_csv: bool, as_json: bool) -> None:
    """The rows as the database returned them, column by column: two columns of one name
    (Postgres names each unaliased aggregate after its function) are both shown; in JSON,
    whose objects cannot hold a name twice, the later ones get a suffix (`min_2`)."""
    keys = _unique(columns)
    if as_json:
        display.print_json([dict(zip(keys, row, strict=True)) for row in rows])
    elif as_csv:
        # csv's own line ending is the RFC's CRLF; POSIX tools (and `sdq sql ... > f.csv`
        # read back by them) expect LF.
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        table = display.rows_table([dict(zip(keys, row, strict=True)) for row in rows], keys,
                                   headers=columns)  # fmt: skip
        display.stdout.print(table)
        console = display.stdout
        unbounded = console.options.update_width(10**6)  # what the cells would take
        if console.measure(table, options=unbounded).maximum > console.width:
            display.hint("cells were cut to fit the terminal: name fewer columns, or give "
                         "--csv or --json")  # fmt: skip


def _unique(columns: list[str]) -> list[str]:
    """Each name, a repeated one with the first free suffix _2, _3...: `a, a` -> `a, a_2`."""
    keys: list[str] = []
    for column in columns:
        key, count = column, 1
        while key in keys or (key != column and key in columns):
            count += 1
            key = f"{column}_{count}"
        keys.append(key)
    return keys


COMMANDS = (sql,)
