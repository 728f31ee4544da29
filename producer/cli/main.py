"""The sdq command line. Reads the settings once, here, and passes them down.

Commands are grouped by what they act on: runs and jobs of any kind (runs.py), each kind's
own commands (producer/<kind>/cli.py), SQL on the history (sql.py), and setting a deployment
up (admin.py).
"""

import logging
import os
import sys
from pathlib import Path

import click
from sqlalchemy.exc import DBAPIError

from sdq.models.db import missing_sqlite, sqlite_file
from sdq.models.faults import free_space, full_disk
from sdq.models.jobs.kinds import KINDS
from sdq.models.settings import Settings
from sdq.producer import display
from sdq.producer.cli import admin, runs, sql
from sdq.producer.cli.common import NothingNamed, interrupted_by
from sdq.producer.datasets import cli as datasets
from sdq.workers.app import create_app, quiet_libraries

# How long a thread that wants Python's lock lets the one running Python keep it before
# asking it to let go (every command's threads): a tenth of CPython's 5 ms. While a
# submit's planning thread computes, its writer, back from each wait on the database's
# socket, waited that long for its turn, and the database meanwhile for its data: a
# 100k-prompt submit took 1.5x its rows' own loading time at 5 ms, 1.4x at 0.5.
SWITCH_SECONDS = 0.0005

# \b keeps Click from re-wrapping the list.
SETTINGS_HELP = """\b
Settings, from the environment (ops/sdq.env.example lists them all):
  SDQ_DATABASE_URL   postgresql://host/db        [default: SQLite in SDQ_HOME]
  SDQ_BROKER_URL     redis://host:6379/0         [default: none; work is done here]
  SDQ_STORE_URL      s3://bucket/prefix, a folder [default: SDQ_HOME/store]
  SDQ_HOME           the embedded home           [default: ./sdq-data]
  AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...  S3 access, as boto3 reads it
  SDQ_BATCH_SIZE, SDQ_LEASE_SECONDS, SDQ_MAX_ATTEMPTS, SDQ_*_TASK_TIME_LIMIT, ...
"""


class SdqGroup(click.Group):
    """Every command's answer to a database without sdq's tables (how to make them), to a
    full disk (which of sdq's places sit on it) and to Ctrl-C where the command has no
    answer of its own."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as interrupt:
            # As a shell reports a command stopped by the signal, not click's "Aborted!"
            # and 1. A command with work in hand answers Ctrl-C itself (the work here, a
            # watch, a send); one that reaches here leaves its transaction undone.
            stopped_by, code = interrupted_by(interrupt)
            display.console.print(f"stopped by {stopped_by}")
            sys.exit(code)
        except NothingNamed as error:
            # Runs live in the SQLite file of the folder a command is run from, by default:
            # "no run 1" from another folder means the wrong file, not a missing run.
            if (database := sqlite_file(ctx.obj.settings.database_url)) is not None:
                error.message += f" (in {database.absolute()})"
            raise
        except Exception as error:
            if isinstance(error, DBAPIError) and (
                missing := missing_sqlite(ctx.obj.settings.database_url)
            ):
                raise click.ClickException(_no_home(missing)) from None
            if isinstance(error, DBAPIError) and _no_schema(error):
                raise click.ClickException(
                    "the database has no sdq tables yet: run `sdq db upgrade`"
                ) from None
            if isinstance(error, DBAPIError) and (refusal := _not_connected(error)):
                raise click.ClickException(refusal) from None
            if not (full := full_disk(error)):
                raise
            raise click.ClickException(
                f"no space left on a disk sdq writes to ({full}); space left: "
                f"{free_space(ctx.obj.settings)}; what each transaction wrote before is kept"
            ) from None


def show_library_output(verbose: bool) -> None:
    """sdq's output is sdq's: libraries' Python warnings would print between its progress
    bars. They are dropped unless --verbose, which also shows what the libraries log."""
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        os.environ["TRANSFORMERS_VERBOSITY"] = os.environ["DIFFUSERS_VERBOSITY"] = "info"
        return
    logging.captureWarnings(True)
    # Without a handler of its own, Python's last-resort handler would print them anyway.
    warnings_log = logging.getLogger("py.warnings")
    warnings_log.addHandler(logging.NullHandler())
    warnings_log.propagate = False


def _no_home(database: Path) -> str:
    return (
        f"no sdq database at {database.absolute()}: without SDQ_DATABASE_URL, sdq keeps its "
        "runs in SDQ_HOME, ./sdq-data under the folder it is run from; run it from the "
        "folder of your runs, or set SDQ_HOME to their sdq-data"
    )


def _not_connected(error: DBAPIError) -> str | None:
    """What stops a connection to Postgres (down, a wrong address, no such database), in
    its own words and what to do; None for an error once connected."""
    said = str(error.orig).strip()
    if not said.startswith("connection failed") and "connection to server" not in said:
        return None
    reason = " ".join(said.split())
    advice = (
        "make it first (`createdb NAME` on the server), then `sdq db upgrade`"
        if "does not exist" in reason
        else "is Postgres running there? `sdq health` names each part that is down"
    )
    return f"cannot connect to the database (SDQ_DATABASE_URL): {reason}; {advice}"


def _no_schema(error: DBAPIError) -> bool:
    # Postgres: undefined_table; SQLite says it in words.
    return getattr(error.orig, "sqlstate", None) == "42P01" or "no such table" in str(error.orig)


@click.group(cls=SdqGroup, epilog=SETTINGS_HELP)
@click.version_option(package_name="sdq")
@click.option("-v", "--verbose", is_flag=True,
              help="Show what libraries log and warn (hidden otherwise).")  # fmt: skip
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """sdq: Stable Diffusion jobs on Celery, Redis, Postgres and S3.

    With no settings, everything runs here, in this process: SQLite and a store folder
    under ./sdq-data, no broker or worker (`sdq run`). Set the variables below to share
    a deployment with workers on other machines (`sdq submit`, `sdq worker`).
    """
    sys.setswitchinterval(SWITCH_SECONDS)
    quiet_libraries()
    show_library_output(verbose)
    try:
        settings = Settings.from_env()
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    ctx.obj = create_app(settings)


kinds = [kind.producer_hooks() for kind in KINDS.values()]
for command in (*(c for kind in kinds for c in kind.commands), *datasets.COMMANDS,
                *runs.COMMANDS, *sql.COMMANDS, *admin.COMMANDS):  # fmt: skip
    main.add_command(command)
# What a kind does to datasets (`sdq dataset filter`) joins the dataset commands.
for command in (c for kind in kinds for c in kind.dataset_commands):
    datasets.dataset.add_command(command)
