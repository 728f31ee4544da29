"""The sdq command line. Reads the settings once, here, and passes them down.

Commands are grouped by what they act on: runs and jobs of any kind (runs.py), each kind's
own commands (producer/<kind>/cli.py), SQL on the history (sql.py), and setting a deployment
up (admin.py).
"""

import click

from sdq.models.settings import Settings
from sdq.producer.cli import admin, runs, sql
from sdq.producer.download import cli as download
from sdq.producer.encode import cli as encode
from sdq.producer.generate import cli as generate
from sdq.producer.train import cli as train
from sdq.workers.app import create_app, quiet_libraries


@click.group()
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
