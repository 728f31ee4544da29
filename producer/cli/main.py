"""The sdq command line. Reads the settings once, here, and passes them down.

Commands are grouped by what they act on: runs and jobs of any kind (runs.py), each kind's
own commands (producer/<kind>/cli.py), SQL on the history (sql.py), and setting a deployment
up (admin.py).
"""

import click
from sqlalchemy.exc import DBAPIError

from sdq.models.settings import Settings
from sdq.producer.cli import admin, runs, sql
from sdq.producer.download import cli as download
from sdq.producer.encode import cli as encode
from sdq.producer.generate import cli as generate
from sdq.producer.train import cli as train
from sdq.workers.app import create_app, quiet_libraries


class SdqGroup(click.Group):
    """Every command's answer to a database without sdq's tables: how to make them."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DBAPIError as error:
            if not _no_schema(error):
                raise
            raise click.ClickException(
                "the database has no sdq tables yet: run `sdq db upgrade`"
            ) from None


def _no_schema(error: DBAPIError) -> bool:
    # Postgres: undefined_table; SQLite says it in words.
    return getattr(error.orig, "sqlstate", None) == "42P01" or "no such table" in str(error.orig)


@click.group(cls=SdqGroup)
@click.version_option(package_name="sdq")
@click.pass_context
def main(ctx: click.Context) -> None:
    """sdq: Stable Diffusion jobs on Celery, Redis, Postgres and S3."""
    quiet_libraries()
    try:
        settings = Settings.from_env()
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    ctx.obj = create_app(settings)


for group in (generate, download, encode, train, runs, sql, admin):
    for command in group.COMMANDS:
        main.add_command(command)
