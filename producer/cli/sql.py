"""`sdq sql`: questions about the history, asked in SQL, answered read-only."""

import csv
import sys
from typing import Any

import click
from sqlalchemy import Connection, text
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
    shards, checkpoints, image_sources...) in a read-only transaction: a statement that
    writes fails and nothing changes."""
    ensure_schema(app)
    with app.engine.connect() as connection:
        _read_only(connection)
        try:
            result = connection.execute(text(query))
        except (DBAPIError, StatementError) as error:
            raise InputError(_reason(error)) from None
        if not result.returns_rows:
            raise InputError("the statement returned no rows")
        columns = list(result.keys())
        rows = [dict(zip(columns, row, strict=True)) for row in result]
        connection.rollback()
    _print(rows, columns, as_csv=as_csv, as_json=as_json)


def _read_only(connection: Connection) -> None:
    """Postgres refuses writes in a read-only transaction; SQLite in query_only mode."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql("SET TRANSACTION READ ONLY")
    else:
        connection.exec_driver_sql("PRAGMA query_only = ON")


def _reason(error: DBAPIError | StatementError) -> str:
    message = str(error.orig or error).strip().splitlines()[0]
    if "read-only" in message or "readonly" in message:
        return f"sdq sql only reads: {message}"
    return message


def _print(rows: list[dict[str, Any]], columns: list[str], *, as_csv: bool, as_json: bool) -> None:
    if as_json:
        display.print_json(rows)
    elif as_csv:
        # csv's own line ending is the RFC's CRLF; POSIX tools (and `sdq sql ... > f.csv`
        # read back by them) expect LF.
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([row[column] for column in columns] for row in rows)
    else:
        display.stdout.print(display.rows_table(rows, columns))


COMMANDS = (sql,)
