"""The generate commands: submit and run prompt files, find and fetch images, galleries."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from sdq.models.generate import galleries
from sdq.models.generate.settings import GenerateSettings
from sdq.models.generate.specs import SAMPLERS
from sdq.models.loras import resolve_lora
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.specs import DTYPES
from sdq.models.store import StoreError
from sdq.models.tables import JobStatus
from sdq.producer import display, lookups
from sdq.producer.cli.common import (
    ensure_store,
    exit_bad_input,
    exit_if_dead,
    found,
    json_option,
    lookup,
    pass_app,
    ready_to_submit,
    report_submission,
    require_broker,
    send_run,
    table,
    watch_run,
)
from sdq.producer.cli.here import work_here
from sdq.producer.generate import lookups as generate_lookups
from sdq.producer.generate.export import FORMATS, export_run
from sdq.producer.generate.gallery import copy_gallery, generation_run
from sdq.producer.generate.plan import DEFAULT_TEMPLATE, Defaults, plan_jobs
from sdq.producer.generate.submit import Batching, Submission, record_run
from sdq.producer.launch import visible_gpus
from sdq.producer.prompts import (
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
from sdq.workers.app import SdqCelery


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


# \b keeps Click from re-wrapping the table.
PROMPT_FILE_HELP = """\b
PROMPTS is a CSV file with a header row. Its columns (only prompt is required):
  prompt           the text to render
  negative_prompt  what to steer away from
  seed             the row's first image's seed; its n images take seed, seed+1, ...
  steps, guidance  denoising steps and classifier-free guidance
  width, height    multiples of 8
  n                images of this row (per style)
  style            this row's style, instead of crossing it with --styles
A value in a row wins over the flag of the same name.
"""


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
                     help="Precision [default: auto: float16 on a GPU, float32 on the "
                          "CPU; float32 for tiny]"),
        click.option("--sampler", type=click.Choice(list(SAMPLERS)),
                     help="The sampler: a diffusers scheduler on the model's noise schedule "
                          "[default: the model's own scheduler]"),
        click.option("--safety-check", is_flag=True,
                     help="Run each image through the model's safety checker: a flagged "
                          "one is recorded as flagged, not stored [default: off]"),
        click.option("--lora", "loras", multiple=True, metavar="FILE|s3://...|NAME[:SCALE]",
                     help="LoRA weights fused into the model at SCALE [default: 1]: a "
                          ".safetensors file, an s3:// URI, or a name given to `sdq model "
                          "push`. Repeatable; in the spec by content."),
        click.option("--batch-size", type=click.IntRange(1, 256),
                     help="Images per pipeline call [default: SDQ_BATCH_SIZE or 8]"),
        json_option,
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
    loras: tuple[str, ...] = ()  # as given; resolved into defaults.loras by prepare()

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
                sampler=options["sampler"],
                safety_check=options["safety_check"],
            ),
            batch_size=options["batch_size"],
            loras=options["loras"],
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


def with_loras(app: SdqCelery, request: Request) -> Request:
    """The request with its `--lora` values resolved to what the specs record."""
    try:
        with app.sessions() as session:
            loras = tuple(resolve_lora(value, session=session) for value in request.loras)
    except (ModelNotFound, StoreError) as error:
        raise click.UsageError(f"--lora: {error}") from None
    return replace(request, defaults=replace(request.defaults, loras=loras))


def prepare(app: SdqCelery, request: Request, *, show: bool) -> Submission:
    """Checks the options and the deployment, then streams the prompt file into a run,
    counting the jobs written when `show`. Any problem in the file rolls the run back: bad
    input writes nothing."""
    try:
        styles = read_styles(request.styles) if request.styles else None
        check_template(request.template, with_styles=bool(styles))
    except InvalidInput as problems:
        exit_bad_input(problems)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    ready_to_submit(app)
    try:
        with app.sessions() as session:
            model = resolve_model(request.model, store=app.store, session=session)
    except (ModelNotFound, StoreError) as error:
        raise click.UsageError(f"--model: {error}") from None
    request = with_loras(app, request)
    planned = plan_jobs(
        read_prompts(request.prompts),
        model=model,
        defaults=request.defaults,
        styles=styles,
        template=request.template,
    )
    settings = app.settings.group(GenerateSettings)
    batching = Batching(request.batch_size or settings.batch_size, settings.calls_per_task)
    try:
        with display.counting("writing jobs", show=show) as written:
            return record_run(
                app.sessions,
                planned,
                model=model,
                source=str(request.prompts),
                options=request.options(),
                batching=batching,
                on_written=written,
            )
    except InvalidInput as problems:
        exit_bad_input(problems)


@click.command(epilog=PROMPT_FILE_HELP)
@generation_options
@click.option("--wait", is_flag=True, help="Show progress until the run finishes.")
@pass_app
def submit(app: SdqCelery, as_json: bool, wait: bool, **options: Any) -> None:
    """Turn a prompt file into generation jobs for the workers."""
    require_broker(app, "submit (`sdq run` works without one)")
    show = display.showing_progress(as_json)
    submission = prepare(app, Request.from_options(options), show=show)
    sent = send_run(app, submission.run_id, total=submission.jobs - submission.cached, show=show)
    if not wait:
        _report_submission(submission, sent.messages, as_json)
        return
    if not as_json:
        display.console.print(f"run {submission.run_id}: {submission.jobs} jobs")
    watch_run(app, submission.run_id, jobs=submission.jobs, show=not as_json)
    report_run(app, submission.run_id, as_json)


@click.command(epilog=PROMPT_FILE_HELP)
@generation_options
@pass_app
def run(app: SdqCelery, as_json: bool, **options: Any) -> None:
    """Do the whole job here, in this process: no broker or worker needed."""
    request = Request.from_options(options)
    if request.defaults.dtype is None and not visible_gpus():
        # Rendered here, on the CPU: half precision crawls there, or fails. An explicit
        # --dtype is kept, and every dtype is recorded in the spec.
        request = replace(request, defaults=replace(request.defaults, dtype="float32"))
    submission = prepare(app, request, show=display.showing_progress(as_json))
    work_here(app, submission.run_id, jobs=submission.jobs)
    report_run(app, submission.run_id, as_json)


def _report_submission(submission: Submission, messages_sent: int, as_json: bool) -> None:
    report_submission(
        {
            "run_id": submission.run_id,
            "jobs": submission.jobs,
            "cached": submission.cached,
            "tasks": messages_sent,
        },
        f"{submission.jobs} jobs in {messages_sent} tasks, {submission.cached} served from "
        f"cache; `sdq status {submission.run_id}` follows it",
        as_json=as_json,
    )


def report_run(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Prints where the run ended and writes its gallery; fails the command on dead jobs."""
    with app.sessions() as session:
        status = lookups.run_status(session, run_id)
    gallery = write_gallery(app, run_id)
    if as_json:
        display.print_json({**status, **gallery})
    else:
        display.show_status(status)
        display.stdout.print(f"images: {app.store.uri('images/')}", soft_wrap=True)
        display.stdout.print(f"gallery: {gallery['gallery_link']}", soft_wrap=True)
    exit_if_dead(app, run_id)


def write_gallery(app: SdqCelery, run_id: int) -> dict[str, str]:
    with app.sessions() as session:
        generation_run(session, run_id)
    return galleries.write_gallery(app.sessions, app.store, run_id)


@click.command()
@click.argument("run_id", type=int)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write a copy here instead, with its images, to open or send anywhere.",
)
@json_option
@pass_app
def gallery(app: SdqCelery, run_id: int, output: Path | None, as_json: bool) -> None:
    """Write RUN's contact sheet (a prompt x style grid) next to its images in the store and
    print the link that opens it: the file in a local store, a presigned HTTPS link (good
    for 7 days) in S3. With -o DIR, a local copy: DIR/gallery.html and DIR/images/."""
    try:
        if output:
            with app.sessions() as session:
                generation_run(session, run_id)
                jobs = galleries.gallery_jobs(session, run_id)
            page = copy_gallery(app.store, run_id, jobs, output)
            written = {"gallery": str(page), "gallery_link": page.resolve().as_uri()}
        else:
            written = write_gallery(app, run_id)
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        display.print_json({"run_id": run_id, **written})
    else:
        click.echo(written["gallery_link"])


@click.command()
@click.argument("job")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="The file to write the PNG to, in a folder that exists.")  # fmt: skip
@click.option("--force", is_flag=True, help="Replace OUTPUT if it exists.")
@json_option
@pass_app
def get(app: SdqCelery, job: str, output: Path, force: bool, as_json: bool) -> None:
    """Copy a job's image out of the store. JOB is a job id, a spec hash (or its first
    characters), or the image's path or URI."""
    # A mistyped -o would otherwise replace a file of the user's, or make a folder of a typo.
    if output.exists() and not force:
        raise click.UsageError(f"{output} exists: give --force to replace it")
    if not output.parent.is_dir():
        raise click.UsageError(f"{output}: no folder {output.parent}")
    with app.sessions() as session, found():
        job_id = lookups.job_named(session, job)
        key = generate_lookups.job_image_key(session, job_id)
    ensure_store(app)
    try:
        app.store.get_file(key, output)
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        display.print_json({"job_id": job_id, "output": str(output), "uri": app.store.uri(key)})
    else:
        click.echo(output)


@click.command()
@click.argument("run_id", type=int)
@click.argument("folder", type=click.Path(file_okay=False, path_type=Path))
@click.option("--format", "format_", type=click.Choice(FORMATS), default="folder",
              show_default=True, help="folder: PNGs and metadata.csv; parquet: one file with "
              "the PNG bytes; webdataset: tar shards of <hash>.png and <hash>.json.")  # fmt: skip
@json_option
@pass_app
def export(app: SdqCelery, run_id: int, folder: Path, format_: str, as_json: bool) -> None:
    """Write RUN's images with a metadata table (prompt, style, seed, model revision, spec
    hash, file name) into FOLDER, for other tools."""
    with app.sessions() as session, found():
        rows = generate_lookups.export_rows(session, run_id)
    ensure_store(app)
    try:
        files = export_run(rows, app.store, folder, run_id=run_id, format=format_)
    except StoreError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        display.print_json(
            {"run_id": run_id, "images": len(rows), "files": [str(f) for f in files]}
        )
    else:
        click.echo(f"run {run_id}: {len(rows)} images written to {folder} ({format_})")


@click.command()
@click.option("--prompt", help="Text the prompt contains (case-insensitive).")
@click.option("--style", help="Text the style contains.")
@click.option("--model", help="Model name, exactly.")
@click.option("--run", "run_id", type=int, help="Only jobs of this run.")
@click.option(
    "--status",
    type=click.Choice([status.value for status in JobStatus]),
    help="Only jobs in this status.",
)
@click.option("--limit", default=50, show_default=True, help="At most this many, newest first.")
@json_option
@pass_app
def find(app: SdqCelery, as_json: bool, **filters: Any) -> None:
    """Find jobs by run or status (of any kind), or images by prompt, style or model."""
    lookup(app, lambda session: generate_lookups.find_jobs(session, **filters), as_json=as_json,
           show=table(["id", "run_id", "kind", "status", "seed", "prompt"]))  # fmt: skip


COMMANDS = (submit, run, find, get, gallery, export)
