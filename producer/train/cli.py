"""The train commands: fit a base model's U-Net on a dataset's latents, and follow a run."""

import difflib
import json
import sys
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import click

from sdq.models.generate.specs import FixedRenders
from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.lifecycle import utcnow
from sdq.models.registry import ModelNotFound
from sdq.models.tables import Run
from sdq.models.train.architectures import (
    UNET_ARCHITECTURES,
    InvalidArchitecture,
    unet_architecture,
)
from sdq.models.train.specs import TRACKERS, TrainOptions
from sdq.producer.cli.common import (
    DEAD_JOBS,
    exit_if_dead,
    found,
    json_option,
    model_name,
    no_worker_for,
    pass_app,
    ready_to_submit,
    report_submission,
    send_run,
    watch_progress,
)
from sdq.producer.cli.here import work_here
from sdq.producer.cli.options import declared_options, from_command_line
from sdq.producer.evaluate.request import (
    EvaluationRequest,
    pop_evaluation_options,
    read_seeded_prompts,
    train_evaluation_options,
    train_evaluation_request,
)
from sdq.producer.train import lookups as train_lookups
from sdq.producer.train import screens
from sdq.producer.train.plan import (
    GPU_MEMORY_OPTION,
    CannotPlan,
    can_plan,
    check_fits,
    plan_request,
    refusal,
)
from sdq.producer.train.plan import plan as plan_memory
from sdq.producer.train.refusals import (
    check_evaluation,
    check_job_length,
    check_trackers,
    checked_options,
)
from sdq.producer.train.screens import report_status
from sdq.producer.train.submit import CannotTrain, TrainSubmission, base_and_start, record_train
from sdq.workers.app import SdqCelery


class TrainGroup(click.Group):
    """`sdq train NAME ...` starts a run; `sdq train status RUN` follows one."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            _check_not_a_typo(args, [name for name in self.commands if name != "start"])
            args = ["start", *args]
        return super().parse_args(ctx, args)


def _check_not_a_typo(args: list[str], commands: list[str]) -> None:
    """`sdq train statuss 5` would start a run on dataset "statuss" and fail for want of
    --steps: a first word near a command's name, without --steps, is that command typed
    wrong."""
    near = difflib.get_close_matches(args[0], commands, n=1, cutoff=0.75)
    if near and "--steps" not in args:
        raise click.UsageError(
            f"no command {args[0]!r}: did you mean `sdq train {near[0]}`? (`sdq train NAME "
            "--base M --steps N` trains on dataset NAME)"
        )


ARCHITECTURES = "FILE|" + "|".join(UNET_ARCHITECTURES)
UNET_CONFIG_HELP = (
    "With --from-scratch: the U-Net's architecture, a named one or a diffusers U-Net config "
    "file. [default: the base's]"
)


@click.group(cls=TrainGroup)
def train() -> None:
    """Train a base model's U-Net on a dataset's latents: `sdq train NAME --base M --steps
    N`. A checkpoint written as a model is one `sdq submit --model RUN@STEP` renders with."""


def _checkpoint_ref(_ctx, _param, value: str | None) -> tuple[int, int | str | None] | None:
    """RUN, RUN@STEP or RUN@best:METRIC."""
    if value is None:
        return None
    run, _, step = value.partition("@")
    best = step.startswith("best:") and len(step) > len("best:")
    if not run.isdigit() or (step and not step.isdigit() and not best):
        raise click.BadParameter(f"{value!r} is not RUN, RUN@STEP (numbers) or RUN@best:METRIC")
    return int(run), (step if best else int(step)) if step else None


@train.command()
@click.argument("name")
@click.option(
    "--base",
    help="The model to start from: any --model source. Its VAE and text encoder made the "
    "latents; its U-Net is the starting point unless --from-scratch. [required unless "
    "--resume-from]",
)
@click.option(
    "--resume-from",
    metavar="RUN[@STEP|@best:METRIC]",
    callback=_checkpoint_ref,
    help="Start from the weights of train run RUN's checkpoint (its newest, at STEP, or the "
    "one whose evaluation METRIC scored best), on the same base: the next phase of a "
    "pre-training, e.g. at another --resolution. The optimizer and the learning-rate "
    "schedule start afresh.",
)
@click.option(
    "--resolution",
    default=256,
    show_default=True,
    type=click.IntRange(min=8),
    help="Train on the dataset's latents encoded at this resolution.",
)
@declared_options(TrainOptions)
@click.option(
    "--unet-config", metavar="FILE|" + "|".join(UNET_ARCHITECTURES), help=UNET_CONFIG_HELP
)
@click.option(
    "--validation-prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A prompt file (as `sdq submit` reads; a row without a seed gets its line): "
    "each checkpoint renders these, with the same seeds, on the generate queue.",
)
@train_evaluation_options
@click.option(
    "--report-to",
    multiple=True,
    type=click.Choice(TRACKERS),
    help="Also send the run's figures (loss, learning rate, samples/s, MFU, every score) "
    "to this tracker (repeatable): TensorBoard event files under runs/RUN/tensorboard/ in "
    "the store; the W&B run sdq-run-RUN (WANDB_PROJECT, else sdq; W&B's own WANDB_* "
    "variables on the workers). Needs the `trackers` extra on the workers.",
)
@click.option("--into", metavar="MODELNAME", callback=model_name,
              help="Register the checkpoints under this name.")  # fmt: skip
@GPU_MEMORY_OPTION
@click.option("--wait", is_flag=True, help="Show progress until the last step.")
@json_option
@pass_app
def start(
    app: SdqCelery,
    name: str,
    base: str | None,
    resume_from: tuple[int, int | str | None] | None,
    resolution: int,
    into: str | None,
    validation_prompts: Path | None,
    report_to: tuple[str, ...],
    gpu_memory: int,
    wait: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Train on dataset NAME's latents made with the base model at the resolution.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    # 1. Refused before anything is written: options that do not go together or fit.
    train_options, evaluation = _checked(app, options, base=base, resume_from=resume_from,
                                         resolution=resolution, gpu_memory=gpu_memory)  # fmt: skip
    prompts = read_seeded_prompts(validation_prompts) if validation_prompts else ()
    check_trackers(app, report_to)
    # 2. The run and its first job.
    ready_to_submit(app)
    submission = _submit(app, name, base, resume_from, resolution, train_options, into, prompts,
                         evaluation, report_to)  # fmt: skip
    # 3. Trained here, with its validation renders, or sent to the workers (and watched).
    if app.settings.embedded:
        train_here(app, submission.run_id, submission.jobs)
    else:
        sent = send_run(app, submission.run_id)
        if not wait:
            _report_submission(submission, sent.messages, as_json)
            return
        _watch(app, submission.run_id, train_options.steps, show=not as_json)
    report_status(app, submission.run_id, as_json)
    exit_if_dead(app, submission.run_id)
    with app.sessions() as session:
        if train_lookups.dead_asked_for(session, submission.run_id):
            sys.exit(DEAD_JOBS)  # its status said which, and why


def _checked(
    app: SdqCelery,
    options: dict[str, Any],
    *,
    base: str | None,
    resume_from: tuple[int, int | str | None] | None,
    resolution: int,
    gpu_memory: int,
) -> tuple[TrainOptions, EvaluationRequest | None]:
    """The run's options and what scores its checkpoints, refused where they do not go
    together, do not fit the GPU or its jobs would outlast the worker's time limit."""
    evaluation_asked = pop_evaluation_options(options)
    train_options = checked_options(app, base, resume_from, options)
    evaluation = train_evaluation_request(evaluation_asked, holdout=train_options.holdout)
    check_evaluation(train_options, evaluation)
    if train_options.unet_config is not None and can_plan():
        check_fits(train_options, resolution, gpu_memory)
    check_job_length(train_options, app.settings.time_limits[TRAIN.queue].soft)
    return train_options, evaluation


def train_here(app: SdqCelery, run_id: int, jobs: int) -> None:
    """The run's jobs in this process, the bar counting steps, then what its checkpoints
    asked for: validation renders, evaluations (each one's renders before its scoring)."""
    with app.sessions() as session:
        steps = session.get_one(Run, run_id).options["steps"]
    done = steps_done(app, run_id, since=utcnow())
    work_here(app, run_id, jobs=jobs, progress=(steps, done))
    with app.sessions() as session:
        asked_for = train_lookups.runs_asked_for(session, run_id)
    for asked, asked_jobs in asked_for:
        work_here(app, asked, jobs=asked_jobs)


def _submit(
    app: SdqCelery,
    name: str,
    base: str | None,
    resume_from: tuple[int, int | str | None] | None,
    resolution: int,
    options: TrainOptions,
    into: str | None,
    prompts: tuple[tuple[str, int], ...],
    evaluation: EvaluationRequest | None,
    report_to: tuple[str, ...],
) -> TrainSubmission:
    with found():
        try:
            with app.sessions() as session:
                identity, start_from = base_and_start(session, app.store, base, resume_from)
            validation = None
            if prompts:
                validation = FixedRenders(prompts=prompts, size=resolution,
                                          scheduler=identity.scheduler,
                                          dtype=identity.default_dtype)  # fmt: skip
            return record_train(
                app.sessions,
                name,
                identity,
                resolution=resolution,
                options=options,
                into=into,
                store=app.store,
                validation=validation,
                start_from=start_from,
                evaluation=evaluation,
                report_to=report_to,
            )
        except (ModelNotFound, CannotTrain, InvalidArchitecture) as error:
            raise click.UsageError(str(error)) from None


def steps_done(app: SdqCelery, run_id: int, since: datetime | None = None) -> Callable[[], int]:
    """The run's last recorded step (since `since`: train_lookups.latest_step), asked anew
    at each call: what its bar counts."""

    def done() -> int:
        with app.sessions() as session:
            return train_lookups.latest_step(session, run_id, since)

    return done


def _watch(
    app: SdqCelery, run_id: int, steps: int, *, show: bool, since: datetime | None = None
) -> None:
    """Step by step until the run closes: every job done, or the chain stopped by a dead
    job."""
    done = steps_done(app, run_id, since)

    def finished() -> int:
        with app.sessions() as session:
            if session.get_one(Run, run_id).finished_at is not None:
                return steps
        # Steps reach the database before their checkpoint: the last one taken is not the
        # run's end, which its closing says.
        return min(done(), steps - 1)

    watch_progress(run_id, f"train run {run_id}", steps, finished, show=show,
                   stalled=no_worker_for(app, run_id))  # fmt: skip


def watch_resumed(app: SdqCelery, run_id: int, *, jobs: int, show: bool) -> None:
    """`sdq resume RUN --wait` on the workers: the bar counts steps, from its checkpoint
    (steps taken after the last one recorded, each stamped by a worker's clock, as it was:
    this machine's clock is not theirs)."""
    with app.sessions() as session:
        steps = session.get_one(Run, run_id).options["steps"]
        last = train_lookups.last_step_at(session, run_id)
    _watch(app, run_id, steps, show=show, since=last + timedelta(microseconds=1) if last else None)


def _report_submission(submission: TrainSubmission, tasks: int, as_json: bool) -> None:
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "model": submission.model,
            "jobs": submission.jobs,
            "samples": submission.samples,
            "held_out": submission.held_out,
            "tasks": tasks,
        },
        f"training on {submission.samples} samples"
        + (f" ({submission.held_out} held out)" if submission.held_out else "")
        + f" in {submission.jobs} train-shard jobs; "
        f"`sdq train status {submission.run_id}` follows it",
        as_json=as_json,
    )


@train.command()
@click.argument("run_id", type=int, metavar="RUN")
@json_option
@pass_app
def status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Progress, ETA, the loss curve and the checkpoints of train run RUN."""
    with found():
        report_status(app, run_id, as_json)


# What a plan takes of a run's options, besides its batch size.
PLANNED = ("world_size", "sharding", "grad_accumulation", "mixed_precision",
           "gradient_checkpointing", "ema", "lora_rank", "lora_targets", "buckets")  # fmt: skip


@train.command()
@click.option(
    "--unet-config",
    required=True,
    metavar=ARCHITECTURES,
    help="The U-Net's architecture: a named one or a diffusers U-Net config file.",
)
@click.option("--resolution", required=True, type=click.IntRange(min=8), help="Image pixels.")
@click.option(
    "--batch-size",
    required=True,
    type=click.IntRange(min=1),
    help="The global batch, as `sdq train` takes it: each GPU's micro-batch is it over "
    "--world-size x --grad-accumulation.",
)
@declared_options(TrainOptions, PLANNED)
@GPU_MEMORY_OPTION
@json_option
def plan(unet_config: str, resolution: int, gpu_memory: int, as_json: bool, **options) -> None:
    """Memory per GPU (parameters, gradients, optimizer, EMA, activations) and FLOPs per
    sample of a training configuration, from its U-Net built on the meta device: nothing
    is loaded or run. Says which option would make a configuration that does not fit."""
    try:
        architecture = unet_architecture(unet_config)
        train_options = TrainOptions(steps=1, **from_command_line(TrainOptions, options))
        found = plan_memory(plan_request(train_options, resolution, gpu_memory) | {
            "unet_config": architecture})  # fmt: skip
    except (ValueError, InvalidArchitecture, CannotPlan) as error:
        raise click.UsageError(str(error)) from None
    if as_json:
        click.echo(json.dumps(found, indent=2))
    else:
        screens.show_plan(found, refusal(found) if not found["fits"] else None)


COMMANDS = (train,)
