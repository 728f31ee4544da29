"""Commands for runs and jobs of any kind: each dispatches on the run's kind."""

import getpass
import socket
from datetime import UTC

import click

from sdq.models.jobs.claims import cancel_jobs, leases_held
from sdq.models.jobs.kinds import kind_named
from sdq.models.jobs.lifecycle import as_utc, retry_jobs
from sdq.models.tables import JobStatus
from sdq.producer import display, lookups
from sdq.producer.cli.common import (
    ensure_store,
    exit_if_dead,
    found,
    json_option,
    lookup,
    pass_app,
    require_broker,
    send_run,
    table,
)
from sdq.producer.cli.here import carry_out
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
@click.argument("job")
@json_option
@pass_app
def show(app: SdqCelery, job: str, as_json: bool) -> None:
    """Everything about one job: spec, timings, worker, output, history. JOB is a job id, a
    spec hash (or its first characters), or an image's path or URI."""
    lookup(
        app,
        lambda session: lookups.job_details(session, lookups.job_named(session, job)),
        as_json=as_json,
        show=display.show_job,
    )


@click.command()
@click.argument("run_id", type=int)
@json_option
@pass_app
def requeue(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Send again every job of RUN that has not finished and that no live worker holds."""
    require_broker(app, "requeue")
    with app.sessions() as session, found():
        lookups.get_run(session, run_id)
    ensure_store(app)
    sent = send_run(app, run_id, show=display.showing_progress(as_json))
    if as_json:
        display.print_json({"run_id": run_id, "jobs": sent.jobs, "tasks": sent.messages})
    else:
        click.echo(f"run {run_id}: sent {sent.jobs} jobs again in {sent.messages} tasks")


@click.command()
@click.argument("run_id", type=int)
@click.option("--wait", is_flag=True, help="With a broker: show progress until it is done.")
@json_option
@pass_app
def resume(app: SdqCelery, run_id: int, wait: bool, as_json: bool) -> None:
    """Finish RUN's jobs that are not done (after Ctrl-C, a crash or a lost broker), reusing
    everything already stored: here without a broker, else sent to the workers."""
    with app.sessions() as session, found():
        run = lookups.get_run(session, run_id)
    ensure_store(app)
    sent = carry_out(app, run_id, jobs=run.job_count, wait=wait, as_json=as_json)
    if sent:
        summary = {"run_id": run_id, "jobs": sent.jobs, "tasks": sent.messages}
        if as_json:
            display.print_json(summary)
        else:
            click.echo(f"run {run_id}: sent {sent.jobs} jobs not done in {sent.messages} tasks")
        return
    report_run = kind_named(run.kind).producer_hooks().report_run
    if report_run is not None:  # as the kind's own command ends
        report_run(app, run_id, as_json)
    else:
        lookup(app, lambda session: lookups.run_status(session, run_id, with_jobs=False),
               as_json=as_json, show=display.show_status)  # fmt: skip
    exit_if_dead(app, run_id)


RETRYABLE = (JobStatus.dead, JobStatus.failed, JobStatus.cancelled)


@click.command()
@click.argument("run_id", type=int)
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice([str(status) for status in RETRYABLE]),
    help="Which jobs to try again (repeat for more) [default: dead, failed and cancelled].",
)
@json_option
@pass_app
def retry(app: SdqCelery, run_id: int, statuses: tuple[str, ...], as_json: bool) -> None:
    """Try RUN's dead, failed or cancelled jobs again from scratch: attempts reset, sent
    again (without a broker, done here). The history records who asked."""
    chosen = [JobStatus(status) for status in statuses] or list(RETRYABLE)
    asked_by = f"{getpass.getuser()}@{socket.gethostname()}"
    ensure_store(app)
    with app.sessions.begin() as session, found():
        jobs = lookups.get_run(session, run_id).job_count
        job_ids = retry_jobs(session, run_id, chosen, asked_by=asked_by)
    if job_ids:
        carry_out(app, run_id, jobs=jobs, wait=False, as_json=as_json)
    if as_json:
        display.print_json({"run_id": run_id, "retried": len(job_ids)})
    else:
        click.echo(f"run {run_id}: {len(job_ids)} jobs sent again")


@click.command()
@click.argument("run_id", type=int)
@json_option
@pass_app
def cancel(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Cancel every job of RUN that no worker holds: not started, or left running by a
    worker that stopped renewing its lease (killed); jobs running on live workers finish."""
    with app.sessions.begin() as session, found():
        lookups.get_run(session, run_id)
        cancelled = cancel_jobs(session, run_id)
        running, until = leases_held(session, run_id)
    if as_json:
        display.print_json({"run_id": run_id, "cancelled": len(cancelled), "running": running})
        return
    click.echo(f"run {run_id}: cancelled {len(cancelled)} jobs")
    if running:
        last = as_utc(until).astimezone(UTC)
        click.echo(
            f"{running} running on their workers' leases, the last until {last:%H:%M:%S} UTC: "
            f"they finish, or, where the worker is gone, `sdq cancel {run_id}` takes them once "
            "the lease has run out"
        )


COMMANDS = (runs, status, show, resume, requeue, retry, cancel)
