"""The train commands: fit a base model's U-Net on a dataset's latents, and follow a run."""

from pathlib import Path
from typing import Any

import click
from sqlalchemy.orm import Session

from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.tables import Run
from sdq.models.training import MIXED_PRECISION, TrainOptions, Validation
from sdq.producer import display
from sdq.producer.cli.common import (
    ensure_schema,
    exit_bad_input,
    found,
    json_option,
    lookup,
    pass_app,
    report_submission,
    send_run,
    work_here,
)
from sdq.producer.generate.prompts import InvalidInput, read_prompts
from sdq.producer.train import lookups as train_lookups
from sdq.producer.train.page import page_key, training_html
from sdq.producer.train.submit import MissingLatents, TrainSubmission, record_train
from sdq.workers.app import SdqCelery


class TrainGroup(click.Group):
    """`sdq train NAME ...` starts a run; `sdq train status RUN` follows one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["start", *args]
        return super().parse_args(ctx, args)


@click.group(cls=TrainGroup)
def train() -> None:
    """Train a base model's U-Net on a dataset's latents: `sdq train NAME --base M --steps
    N`. Each checkpoint is a model `sdq submit --model RUN@STEP` renders with."""


@train.command()
@click.argument("name")
@click.option("--base", required=True, help="The model to start from: any --model source.")
@click.option(
    "--resolution",
    default=256,
    show_default=True,
    type=click.IntRange(min=8),
    help="Train on the dataset's latents encoded at this resolution.",
)
@click.option("--steps", required=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option(
    "--batch-size",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Samples per optimizer step.",
)
@click.option(
    "--lr",
    default=1e-4,
    show_default=True,
    type=click.FloatRange(min=0),
    help="AdamW learning rate, after warmup.",
)
@click.option(
    "--lr-warmup",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Steps of linear warmup from 0 to --lr.",
)
@click.option(
    "--checkpoint-every",
    default=100,
    show_default=True,
    type=click.IntRange(min=1),
    help="Steps per train-shard job: each ends with a checkpoint.",
)
@click.option("--ema", default=0.9999, show_default=True, help="EMA decay; 0 keeps none.")
@click.option("--min-snr", default=5.0, show_default=True, help="Min-SNR gamma; 0 for plain MSE.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Decides the data order and the noise: a rerun makes the same model.",
)
@click.option(
    "--mixed-precision",
    type=click.Choice(MIXED_PRECISION),
    default="no",
    show_default=True,
    help="Autocast on the GPU (fp16 with a gradient scaler).",
)
@click.option(
    "--gradient-checkpointing",
    is_flag=True,
    help="Recompute activations in the backward pass: less memory, more time.",
)
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the U-Net.")
@click.option(
    "--validation-prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A prompt file (as `sdq submit` reads; a row without a seed gets its line): "
    "each checkpoint renders these, with the same seeds, on the generate queue.",
)
@click.option("--into", metavar="MODELNAME", help="Register the checkpoints under this name.")
@click.option("--wait", is_flag=True, help="Show progress until the last step.")
@json_option
@pass_app
def start(
    app: SdqCelery,
    name: str,
    base: str,
    resolution: int,
    into: str | None,
    validation_prompts: Path | None,
    wait: bool,
    as_json: bool,
    ema: float,
    min_snr: float,
    compile_: bool,
    **options: Any,
) -> None:
    """Train on dataset NAME's latents made with the base model at the resolution.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    if into is not None and ("@" in into or "/" in into):
        raise click.UsageError(f"--into {into!r}: a model name has no '@' or '/'")
    try:
        train_options = TrainOptions(
            ema=ema or None, min_snr=min_snr or None, compile=compile_, **options
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    prompts = _validation_prompts(validation_prompts) if validation_prompts else ()
    ensure_schema(app)
    submission = _submit(app, name, base, resolution, train_options, into, prompts)
    if app.settings.embedded:
        work_here(app, submission.run_id, jobs=submission.jobs)
        with app.sessions() as session:
            validations = train_lookups.validation_runs(session, submission.run_id)
        for run_id, jobs in validations:
            work_here(app, run_id, jobs=jobs)
    else:
        sent = send_run(app, submission.run_id)
        if not wait:
            _report_submission(submission, sent.messages, as_json)
            return
        _watch(app, submission.run_id, train_options.steps, show=not as_json)
    _report_status(app, submission.run_id, as_json)


def _validation_prompts(path: Path) -> tuple[tuple[str, int], ...]:
    try:
        return tuple(
            (row.prompt, row.seed if row.seed is not None else row.line)
            for row in read_prompts(path)
        )
    except InvalidInput as problems:
        exit_bad_input(problems)


def _submit(
    app: SdqCelery,
    name: str,
    base: str,
    resolution: int,
    options: TrainOptions,
    into: str | None,
    prompts: tuple[tuple[str, int], ...],
) -> TrainSubmission:
    with found():
        try:
            with app.sessions() as session:
                identity = resolve_model(base, store=app.store, session=session)
            validation = None
            if prompts:
                validation = Validation(
                    prompts=prompts,
                    size=resolution,
                    scheduler=identity.scheduler,
                    dtype=identity.default_dtype,
                )
            return record_train(
                app.sessions,
                name,
                identity,
                resolution=resolution,
                options=options,
                into=into,
                validation=validation,
            )
        except (ModelNotFound, MissingLatents) as error:
            raise click.UsageError(str(error)) from None


def _watch(app: SdqCelery, run_id: int, steps: int, *, show: bool) -> None:
    """Step by step until the run closes: every job done, or the chain stopped by a dead
    job."""

    def finished() -> int:
        with app.sessions() as session:
            if session.get_one(Run, run_id).finished_at is not None:
                return steps
            return train_lookups.latest_step(session, run_id)

    display.watch(f"train run {run_id}", steps, finished, show=show)


def _report_submission(submission: TrainSubmission, tasks: int, as_json: bool) -> None:
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "model": submission.model,
            "jobs": submission.jobs,
            "samples": submission.samples,
            "tasks": tasks,
        },
        f"training on {submission.samples} samples in {submission.jobs} train-shard jobs; "
        f"`sdq train status {submission.run_id}` follows it",
        as_json=as_json,
    )


def _report_status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """The run's status, with its page (loss curve, validation images) written anew."""

    def status_and_page(session: Session) -> dict[str, Any]:
        status = train_lookups.train_status(session, run_id)
        page = training_html(status, train_lookups.validation_images(session, run_id))
        status["page"] = app.store.put_bytes(
            page_key(run_id), page.encode(), content_type="text/html; charset=utf-8"
        )
        return status

    lookup(app, status_and_page, as_json=as_json, show=display.show_training)


@train.command()
@click.argument("run_id", type=int, metavar="RUN")
@json_option
@pass_app
def status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Progress, ETA, the loss curve and the checkpoints of train run RUN."""
    with found():
        _report_status(app, run_id, as_json)


COMMANDS = (train,)
