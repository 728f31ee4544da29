"""The sdq command line. Reads the settings once, here, and passes them down."""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from models.lifecycle import cancel_jobs
from models.registry import ModelNotFound, push_model, resolve_model
from models.settings import Settings
from models.specs import DTYPES
from models.store import StoreError
from models.tables import FINISHED, JobStatus, Run
from producer import display, lookups
from producer.gallery import gallery_html, gallery_key
from producer.plan import DEFAULT_TEMPLATE, Defaults, plan_jobs
from producer.prompts import (
    InvalidInput,
    check_template,
    parse_count,
    parse_guidance,
    parse_seed,
    parse_size,
    parse_steps,
    read_prompts,
    read_styles,
)
from producer.submit import (
    Batching,
    EnqueueFailed,
    Submission,
    enqueue,
    record_run,
    resendable,
)
from workers.app import SdqCelery, create_app

BAD_INPUT = 2


def _validated(parse):
    """Click callback running one of the prompt-file parsers on a flag's value."""

    def callback(_ctx, param, value):
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as error:
            raise click.BadParameter(str(error), param=param) from None

    return callback


def generation_options(command):
    options = [
        click.argument("prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path)),
        click.option("--styles", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="File with one style per line; every row is crossed with every style."),
        click.option("--template", default=DEFAULT_TEMPLATE, show_default=True,
                     help="How a row's prompt and a style make the final prompt."),
        click.option("--model", default="tiny", show_default=True,
                     help="tiny, a diffusers folder, s3://bucket/prefix, a pushed name, a hub id."),
        click.option("--steps", default="25", show_default=True, metavar="N",
                     callback=_validated(parse_steps), help="Denoising steps."),
        click.option("--guidance", default="7.5", show_default=True, metavar="SCALE",
                     callback=_validated(parse_guidance), help="Classifier-free guidance."),
        click.option("--size", callback=_validated(parse_size), metavar="WxH",
                     help="WIDTHxHEIGHT, multiples of 8 [default: the model's native size]"),
        click.option("--seed", callback=_validated(parse_seed), metavar="SEED",
                     help="Seed of each row's first image [default: drawn at random and stored]"),
        click.option("--n", "count", default="1", show_default=True, metavar="N",
                     callback=_validated(parse_count), help="Images per row and style."),
        click.option("--negative-prompt", default="", help="For rows without their own."),
        click.option("--dtype", type=click.Choice(DTYPES),
                     help="[default: float16, float32 for tiny]"),
        click.option("--batch-size", type=click.IntRange(1, 256),
                     help="Images per pipeline call [default: SDQ_BATCH_SIZE or 8]"),
        click.option("--json", "as_json", is_flag=True, help="Print JSON."),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


@dataclass(frozen=True)
class Request:
    prompts: Path
    styles: Path | None
    template: str
    model: str
    defaults: Defaults
    batch_size: int | None

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "Request":
        width, height = options["size"] or (None, None)
        return cls(
            prompts=options["prompts"],
            styles=options["styles"],
            template=options["template"],
            model=options["model"],
            defaults=Defaults(
                steps=options["steps"],
                guidance=options["guidance"],
                width=width,
                height=height,
                seed=options["seed"],
                n=options["count"],
                negative_prompt=options["negative_prompt"],
                dtype=options["dtype"],
            ),
            batch_size=options["batch_size"],
        )

    def options(self) -> dict[str, Any]:
        """What the run records of how it was asked for."""
        return {
            "styles": str(self.styles) if self.styles else None,
            "template": self.template,
            "model": self.model,
            "defaults": self.defaults.__dict__,
            "batch_size": self.batch_size,
        }


def prepare(app: SdqCelery, request: Request) -> Submission:
    """Validates everything, then writes the run: bad input writes nothing."""
    try:
        rows = read_prompts(request.prompts)
        styles = read_styles(request.styles) if request.styles else None
        check_template(request.template, with_styles=bool(styles))
    except InvalidInput as problems:
        for error in problems.errors:
            click.echo(str(error), err=True)
        click.echo(f"{len(problems.errors)} problem(s); nothing was submitted.", err=True)
        sys.exit(BAD_INPUT)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    ensure_schema(app)
    try:
        # A store the workers cannot write to would fail every job: say so before any is made.
        app.store.check()
    except StoreError as error:
        raise click.ClickException(f"object store {app.settings.store_url}: {error}") from None
    try:
        with app.sessions() as session:
            model = resolve_model(request.model, store=app.store, session=session)
    except (ModelNotFound, StoreError) as error:
        raise click.UsageError(f"--model: {error}") from None
    planned = plan_jobs(
        rows, model=model, defaults=request.defaults, styles=styles, template=request.template
    )
    return record_run(
        app.sessions,
        planned,
        model=model,
        source=str(request.prompts),
        options=request.options(),
        batching=batching(app, request.batch_size),
    )


def batching(app: SdqCelery, batch_size: int | None) -> Batching:
    return Batching(batch_size or app.settings.batch_size, app.settings.calls_per_task)


def ensure_schema(app: SdqCelery) -> None:
    """Embedded SQLite is created on first use; a shared database is migrated on purpose."""
    from migrations import is_current, upgrade

    if app.engine.dialect.name == "sqlite":
        upgrade(app.engine)
    elif not is_current(app.engine):
        raise click.ClickException("the database schema is not current: run `sdq db upgrade`")


def submission_json(submission: Submission) -> dict[str, Any]:
    return {
        "run_id": submission.run_id,
        "jobs": submission.jobs,
        "cached": submission.cached,
        "tasks": len(submission.tasks),
    }


pass_app = click.make_pass_decorator(SdqCelery)


@click.group()
@click.version_option(package_name="sdq")
@click.pass_context
def main(ctx: click.Context) -> None:
    """sdq: Stable Diffusion jobs on Celery, Redis, Postgres and S3."""
    try:
        settings = Settings.from_env()
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    ctx.obj = create_app(settings)


@main.command()
@generation_options
@click.option("--wait", is_flag=True, help="Show progress until the run finishes.")
@pass_app
def submit(app: SdqCelery, as_json: bool, wait: bool, **options: Any) -> None:
    """Turn a prompt file into generation jobs for the workers."""
    if app.settings.embedded:
        raise click.UsageError("no broker configured (SDQ_BROKER_URL); `sdq run` works without one")
    submission = prepare(app, Request.from_options(options))
    try:
        enqueue(app, app.sessions, submission.run_id, submission.tasks, submission.batching)
    except EnqueueFailed as error:
        raise click.ClickException(str(error)) from None
    if not wait:
        _report_submission(submission, as_json)
        return
    if not as_json:
        display.console.print(f"run {submission.run_id}: {submission.jobs} jobs")
    _finish(app, submission, as_json)


@main.command()
@generation_options
@pass_app
def run(app: SdqCelery, as_json: bool, **options: Any) -> None:
    """Do the whole job here, in this process: no broker or worker needed."""
    import workers.tasks  # noqa: F401  (registers the tasks with the app)
    from workers.app import GENERATE_TASK

    submission = prepare(app, Request.from_options(options))
    task = app.tasks[GENERATE_TASK]
    with display.progress() as bar:
        progress = bar.add_task(f"run {submission.run_id}", total=submission.jobs)
        bar.update(progress, completed=submission.cached)
        for job_ids in submission.tasks:
            # A retry inside apply() runs at once, in this process; only a crash is left here.
            result = task.apply(args=[job_ids, submission.batching.batch_size])
            if result.failed():
                raise result.result
            bar.advance(progress, len(job_ids))
    _finish(app, submission, as_json, wait=False)


def _report_submission(submission: Submission, as_json: bool) -> None:
    if as_json:
        display.print_json(submission_json(submission))
        return
    click.echo(submission.run_id)
    display.console.print(
        f"{submission.jobs} jobs in {len(submission.tasks)} tasks, "
        f"{submission.cached} served from cache; `sdq status {submission.run_id}` follows it"
    )


def _finish(app: SdqCelery, submission: Submission, as_json: bool, *, wait: bool = True) -> None:
    """Waits for the run, prints where it ended, and fails the command if any job failed."""

    def finished() -> int:
        with app.sessions() as session:
            counts = lookups.status_counts(session, submission.run_id)
        return sum(counts[status] for status in FINISHED)

    if wait:
        display.watch(submission.jobs, finished, show=not as_json)
    _report_run(app, submission.run_id, as_json)


def _report_run(app: SdqCelery, run_id: int, as_json: bool) -> None:
    with app.sessions() as session:
        status = lookups.run_status(session, run_id)
    gallery = write_gallery(app, run_id)
    if as_json:
        display.print_json({**status, "gallery": gallery})
    else:
        display.show_status(status)
        display.stdout.print(f"images: {app.store.uri('images/')}", soft_wrap=True)
        display.stdout.print(f"gallery: {gallery}", soft_wrap=True)
    if status["dead"]:
        sys.exit(1)


def write_gallery(app: SdqCelery, run_id: int) -> str:
    with app.sessions() as session, _found():
        jobs = lookups.gallery_jobs(session, run_id)
    page = gallery_html(run_id, jobs).encode()
    return app.store.put_bytes(gallery_key(run_id), page, content_type="text/html; charset=utf-8")


@main.command()
@click.argument("run_id", type=int)
@click.option("--batch-size", type=click.IntRange(1, 256), help="[default: SDQ_BATCH_SIZE or 8]")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def requeue(app: SdqCelery, run_id: int, batch_size: int | None, as_json: bool) -> None:
    """Send again every job of RUN that has not finished and that no live worker holds."""
    with app.sessions() as session:
        if session.get(Run, run_id) is None:
            raise click.ClickException(f"no run {run_id}")
        jobs = resendable(session, run_id)
    sizes = batching(app, batch_size)
    groups = sizes.tasks(jobs)
    try:
        enqueue(app, app.sessions, run_id, groups, sizes)
    except EnqueueFailed as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        display.print_json({"run_id": run_id, "jobs": len(jobs), "tasks": len(groups)})
    else:
        click.echo(f"run {run_id}: sent {len(jobs)} jobs again in {len(groups)} tasks")


@main.command()
@click.argument("run_id", type=int)
@pass_app
def cancel(app: SdqCelery, run_id: int) -> None:
    """Cancel every job of RUN that no worker has started; running jobs finish."""
    with app.sessions.begin() as session:
        if session.get(Run, run_id) is None:
            raise click.ClickException(f"no run {run_id}")
        cancelled = cancel_jobs(session, run_id)
    click.echo(f"run {run_id}: cancelled {len(cancelled)} jobs")


@main.command()
@click.option("--limit", default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def runs(app: SdqCelery, limit: int, as_json: bool) -> None:
    """The most recent runs."""
    with app.sessions() as session:
        rows = lookups.recent_runs(session, limit)
    if as_json:
        display.print_json(rows)
    else:
        columns = ["run_id", "created_at", "source", "total", "counts"]
        display.stdout.print(display.rows_table(rows, columns))


@main.command()
@click.argument("run_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Counts by status, throughput and ETA of a run."""
    with app.sessions() as session, _found():
        result = lookups.run_status(session, run_id, with_jobs=as_json)
    if as_json:
        display.print_json(result)
    else:
        display.show_status(result)


@main.command()
@click.argument("job_id", type=int)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def show(app: SdqCelery, job_id: int, as_json: bool) -> None:
    """Everything about one job: spec, timings, worker, output, history."""
    with app.sessions() as session, _found():
        job = lookups.job_details(session, job_id)
    if as_json:
        display.print_json(job)
        return
    display.show_job(job)


@main.command()
@click.argument("run_id", type=int)
@pass_app
def gallery(app: SdqCelery, run_id: int) -> None:
    """Write RUN's contact sheet (a line x style grid) next to its images in the store."""
    try:
        click.echo(write_gallery(app, run_id))
    except StoreError as error:
        raise click.ClickException(str(error)) from None


@main.command()
@click.argument("job_id", type=int)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@pass_app
def get(app: SdqCelery, job_id: int, output: Path) -> None:
    """Copy a job's image out of the store."""
    with app.sessions() as session, _found():
        key = lookups.job_image_key(session, job_id)
    try:
        app.store.get_file(key, output)
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    click.echo(output)


@main.command()
@click.option("--prompt", help="Text the prompt contains (case-insensitive).")
@click.option("--style", help="Text the style contains.")
@click.option("--model", help="Model name, exactly.")
@click.option("--run", "run_id", type=int)
@click.option("--status", type=click.Choice([status.value for status in JobStatus]))
@click.option("--limit", default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True)
@pass_app
def find(app: SdqCelery, as_json: bool, **filters: Any) -> None:
    """Find jobs by prompt, style, model, run or status."""
    with app.sessions() as session:
        rows = lookups.find_jobs(session, **filters)
    if as_json:
        display.print_json(rows)
    else:
        columns = ["id", "run_id", "status", "seed", "prompt"]
        display.stdout.print(display.rows_table(rows, columns))


@contextmanager
def _found() -> Iterator[None]:
    """Turns a lookup's NotFound into a clean command-line error."""
    try:
        yield
    except lookups.NotFound as error:
        raise click.ClickException(str(error)) from None


@main.group()
def db() -> None:
    """The database schema."""


@db.command()
@pass_app
def upgrade(app: SdqCelery) -> None:
    """Apply every migration not applied yet."""
    from migrations import upgrade as upgrade_schema

    upgrade_schema(app.engine)
    click.echo(f"database at the newest schema: {app.engine.url.render_as_string()}")


@main.group()
def model() -> None:
    """The model registry."""


@model.command()
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("name")
@pass_app
def push(app: SdqCelery, source: Path, name: str) -> None:
    """Copy the pipeline folder SOURCE into the store, registered as NAME."""
    ensure_schema(app)
    try:
        with app.sessions.begin() as session:
            pushed = push_model(source, name, store=app.store, session=session)
    except (ModelNotFound, StoreError) as error:
        raise click.ClickException(str(error)) from None
    where = app.store.uri(pushed.prefix)
    done = "pushed to" if pushed.uploaded else "already in the store at"
    click.echo(f"{name}: revision {pushed.identity.revision[:16]} {done} {where}")


@model.command(name="list")
@click.option("--json", "as_json", is_flag=True)
@pass_app
def list_models(app: SdqCelery, as_json: bool) -> None:
    """Every model identity sdq has seen or been given."""
    with app.sessions() as session:
        rows = lookups.known_models(session)
    if as_json:
        display.print_json(rows)
    else:
        display.stdout.print(display.rows_table(rows, ["name", "revision", "source", "created_at"]))


@main.group()
def worker() -> None:
    """Start worker processes (plain Celery workers underneath)."""


@worker.command()
@click.option("--gpus", help="Comma-separated GPU indices [default: every GPU nvidia-smi lists]")
@click.option("--loglevel", default="info", show_default=True)
@pass_app
def gpu(app: SdqCelery, gpus: str | None, loglevel: str) -> None:
    """One process per GPU for generate, encode and train; one CPU process if there is no GPU."""
    from producer.launch import gpu_workers, supervise, visible_gpus

    _require_broker(app)
    indices = [gpu.strip() for gpu in gpus.split(",") if gpu.strip()] if gpus else visible_gpus()
    sys.exit(supervise(gpu_workers(indices, loglevel=loglevel)))


@worker.command()
@click.option(
    "--concurrency", type=click.IntRange(1), default=os.cpu_count() or 1, show_default=True
)
@click.option("--loglevel", default="info", show_default=True)
@pass_app
def cpu(app: SdqCelery, concurrency: int, loglevel: str) -> None:
    """The CPU pool: download and maintenance queues."""
    from producer.launch import cpu_workers, supervise

    _require_broker(app)
    sys.exit(supervise(cpu_workers(concurrency, loglevel=loglevel)))


def _require_broker(app: SdqCelery) -> None:
    if app.settings.embedded:
        raise click.UsageError(
            "workers need a broker: set SDQ_BROKER_URL (e.g. redis://host:6379/0)"
        )


if __name__ == "__main__":
    main()
