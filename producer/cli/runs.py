"""Commands for runs and jobs of any kind: each dispatches on the run's kind."""

import click

from sdq.models.jobs.lifecycle import cancel_jobs
from sdq.producer import display, lookups
from sdq.producer.cli.common import (
    found,
    json_option,
    lookup,
    pass_app,
    require_broker,
    send_run,
    table,
)
from sdq.workers.app import SdqCelery


@click.command()
@click.option("--limit", default=20, show_default=True, help="How many runs, newest first.")
@json_option
@pass_app
def runs(app: SdqCelery, limit: int, as_json: bool) -> None:
    """The most recent runs of every kind, with their jobs counted by status."""
    columns = ["run_id", "kind", "created_at", "source", "total", "counts"]
    lookup(app, lambda session: lookups.recent_runs(session, limit),
           as_json=as_json, show=table(columns))  # fmt: skip


@click.command()
@click.argument("run_id", type=int)
@json_option
@pass_app
def status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Counts by status, throughput and ETA of RUN (--json adds every job)."""
    lookup(app, lambda session: lookups.run_status(session, run_id, with_jobs=as_json),
           as_json=as_json, show=display.show_status)  # fmt: skip


@click.command()
@click.argument("job_id", type=int)
@json_option
@pass_app
def show(app: SdqCelery, job_id: int, as_json: bool) -> None:
    """Everything about one job: spec, timings, worker, output, history."""
    lookup(app, lambda session: lookups.job_details(session, job_id),
           as_json=as_json, show=display.show_job)  # fmt: skip


@click.command()
@click.argument("run_id", type=int)
@json_option
@pass_app
def requeue(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Send again every job of RUN that has not finished and that no live worker holds."""
    require_broker(app, "requeue")
    with app.sessions() as session, found():
        lookups.get_run(session, run_id)
    sent = send_run(app, run_id)
    if as_json:
        display.print_json({"run_id": run_id, "jobs": sent.jobs, "tasks": sent.messages})
    else:
        click.echo(f"run {run_id}: sent {sent.jobs} jobs again in {sent.messages} tasks")


@click.command()
@click.argument("run_id", type=int)
@json_option
@pass_app
def cancel(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Cancel every job of RUN that no worker has started; running jobs finish."""
    with app.sessions.begin() as session, found():
        lookups.get_run(session, run_id)
        cancelled = cancel_jobs(session, run_id)
    if as_json:
        display.print_json({"run_id": run_id, "cancelled": len(cancelled)})
    else:
        click.echo(f"run {run_id}: cancelled {len(cancelled)} jobs")


COMMANDS = (runs, status, show, requeue, cancel)
