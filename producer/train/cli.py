"""The train commands: fit a base model's U-Net on a dataset's latents, and follow a run."""

import difflib
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from sqlalchemy.orm import Session

from sdq.models.architectures import UNET_ARCHITECTURES, InvalidArchitecture, unet_architecture
from sdq.models.generate.galleries import store_image_link
from sdq.models.jobs.kinds import TRAIN
from sdq.models.registry import ModelNotFound, resolve_model
from sdq.models.store import LINK_SECONDS
from sdq.models.tables import Run
from sdq.models.train.specs import (
    GRAD_COMMS,
    LR_SCHEDULES,
    MIXED_PRECISION,
    SHARDINGS,
    TRAINING_SHARE_OF_TIME_LIMIT,
    TrainOptions,
    Validation,
)
from sdq.producer import display
from sdq.producer.cli.common import (
    exit_bad_input,
    found,
    json_option,
    lookup,
    pass_app,
    ready_to_submit,
    report_submission,
    send_run,
    watch_progress,
    work_here,
)
from sdq.producer.errors import InvalidInput
from sdq.producer.prompts import read_prompts
from sdq.producer.train import lookups as train_lookups
from sdq.producer.train.page import page_key, training_html
from sdq.producer.train.plan import DEFAULT_GPU_MEMORY, CannotPlan, can_plan, memory_size, refusal
from sdq.producer.train.plan import plan as plan_memory
from sdq.producer.train.submit import (
    CannotTrain,
    TrainSubmission,
    record_train,
    start_checkpoint,
)
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


MIXED_PRECISION_OPTION = click.option(
    "--mixed-precision",
    type=click.Choice(MIXED_PRECISION),
    default="auto",
    show_default=True,
    help="Autocast on the GPU (fp16 with a gradient scaler); auto is bf16 on a GPU and "
    "none on a CPU.",
)


WORLD_SIZE_OPTION = click.option(
    "--world-size",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Data-parallel ranks, one GPU each (CPU processes without GPUs), that every "
    "train-shard job runs on; each trains on its share of every batch. A worker started "
    "with `sdq worker gpu --train-ranks N` takes runs of world size up to N.",
)
SHARDING_OPTION = click.option(
    "--sharding",
    type=click.Choice(SHARDINGS),
    default="none",
    show_default=True,
    help="Spread the training state over the ranks (FSDP2): grad-op shards gradients, "
    "optimizer and EMA (ZeRO-2); full shards the weights too (ZeRO-3), for a model whose "
    "state does not fit one GPU. Checkpoints are then written by every rank, its own part.",
)
GRAD_ACCUMULATION_OPTION = click.option(
    "--grad-accumulation",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Micro-batches per optimizer step on each rank: a batch larger than fits at once.",
)
GRADIENT_CHECKPOINTING_OPTION = click.option(
    "--gradient-checkpointing",
    is_flag=True,
    help="Recompute activations in the backward pass: less memory, more time.",
)
EMA_OPTION = click.option(
    "--ema", default=0.9999, show_default=True, help="EMA decay; 0 keeps none."
)
GPU_MEMORY_OPTION = click.option(
    "--gpu-memory",
    default=DEFAULT_GPU_MEMORY,
    show_default=True,
    callback=memory_size,
    help="Each GPU's memory (80GB, 40GiB, ...): a configuration planned on the meta device "
    "(see `sdq train plan`) that it cannot hold is refused; `sdq train` plans runs given "
    "--unet-config, before they are queued.",
)


@click.group(cls=TrainGroup)
def train() -> None:
    """Train a base model's U-Net on a dataset's latents: `sdq train NAME --base M --steps
    N`. A checkpoint written as a model is one `sdq submit --model RUN@STEP` renders with."""


def _checkpoint_ref(_ctx, _param, value: str | None) -> tuple[int, int | None] | None:
    """RUN or RUN@STEP."""
    if value is None:
        return None
    run, _, step = value.partition("@")
    if not run.isdigit() or (step and not step.isdigit()):
        raise click.BadParameter(f"{value!r} is not RUN or RUN@STEP (numbers)")
    return int(run), int(step) if step else None


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
    metavar="RUN[@STEP]",
    callback=_checkpoint_ref,
    help="Start from the weights of train run RUN's checkpoint (its newest, or at STEP), on "
    "the same base: the next phase of a pre-training, e.g. at another --resolution. The "
    "optimizer and the learning-rate schedule start afresh.",
)
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
    help="Samples per optimizer step, over all ranks and micro-batches (the global batch).",
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
@click.option(
    "--checkpoint-minutes",
    type=click.FloatRange(min=0, min_open=True),
    help="Also end a job, with its checkpoint, after this many minutes of steps (its next "
    "job goes on from there): a job's length in time. It must fit the train queue's time "
    "limit. [default: --checkpoint-every alone]",
)
@click.option(
    "--lr-schedule",
    type=click.Choice(LR_SCHEDULES),
    default="constant",
    show_default=True,
    help="After warmup: hold --lr, or bring it down to 0 by the last step.",
)
@WORLD_SIZE_OPTION
@SHARDING_OPTION
@click.option(
    "--grad-comm",
    type=click.Choice(GRAD_COMMS),
    default="fp32",
    show_default=True,
    help="The precision gradients are averaged across ranks in: bf16 halves what crosses "
    "between nodes, at bf16's rounding of each rank's gradient.",
)
@click.option(
    "--nodes",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Machines the --world-size ranks are spread over, evenly: each job's gang of "
    "train workers gathers through the database (see the README's multi-node section).",
)
@click.option(
    "--data-lanes",
    type=click.IntRange(min=1),
    help="Lanes the run's latent shards are dealt to; each rank reads whole lanes, so the "
    "world size must divide them, and they the batch size. Runs with the same lanes train "
    "on the same samples at any world size. [default: the most, up to 8 or the world "
    "size, that divide the batch]",
)
@GRAD_ACCUMULATION_OPTION
@click.option(
    "--max-grad-norm",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Clip the gradients' global norm to this; 0 clips nothing.",
)
@click.option(
    "--caption-dropout",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0, max=1, max_open=True),
    help="Share of samples trained on the empty prompt instead of their caption, so that "
    "the model serves classifier-free guidance (0.1 is usual for pre-training).",
)
@click.option(
    "--noise-offset",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Offset noise strength (0.05-0.1 lets the model learn very dark or bright images).",
)
@click.option(
    "--keep-checkpoints",
    type=click.IntRange(min=1),
    help="Keep this many newest checkpoints in the store; older ones are deleted (their "
    "rows stay, marked). [default: every one]",
)
@click.option(
    "--export-every",
    type=click.IntRange(min=1),
    help="Also write a whole pipeline (a model `--model RUN@STEP` renders with) every this "
    "many steps. The last checkpoint and those with validation renders always are; the "
    "others hold the training state only.",
)
@click.option(
    "--from-scratch",
    is_flag=True,
    help="Random weights instead of the base's U-Net, drawn from --seed.",
)
@click.option(
    "--unet-config",
    metavar="FILE|" + "|".join(UNET_ARCHITECTURES),
    help="With --from-scratch: the U-Net's architecture, a named one or a diffusers U-Net "
    "config file. [default: the base's]",
)
@EMA_OPTION
@click.option("--min-snr", default=5.0, show_default=True, help="Min-SNR gamma; 0 for plain MSE.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Decides the data order and the noise: a rerun makes the same model.",
)
@MIXED_PRECISION_OPTION
@GRADIENT_CHECKPOINTING_OPTION
@click.option("--compile", "compile_", is_flag=True, help="torch.compile the U-Net.")
@click.option(
    "--validation-prompts",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A prompt file (as `sdq submit` reads; a row without a seed gets its line): "
    "each checkpoint renders these, with the same seeds, on the generate queue.",
)
@click.option("--into", metavar="MODELNAME", help="Register the checkpoints under this name.")
@GPU_MEMORY_OPTION
@click.option("--wait", is_flag=True, help="Show progress until the last step.")
@json_option
@pass_app
def start(
    app: SdqCelery,
    name: str,
    base: str | None,
    resume_from: tuple[int, int | None] | None,
    resolution: int,
    into: str | None,
    validation_prompts: Path | None,
    gpu_memory: int,
    wait: bool,
    as_json: bool,
    **options: Any,
) -> None:
    """Train on dataset NAME's latents made with the base model at the resolution.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    # 1. Options that cannot go together, a configuration that cannot fit: refused before
    #    anything is written.
    train_options = _checked_options(app, base, resume_from, into, options)
    prompts = _validation_prompts(validation_prompts) if validation_prompts else ()
    if train_options.unet_config is not None and can_plan():
        _check_fits(train_options, resolution, gpu_memory)
    _check_job_length(train_options, app.settings.time_limits[TRAIN.queue].soft)
    # 2. The run and its first job.
    ready_to_submit(app)
    submission = _submit(app, name, base, resume_from, resolution, train_options, into, prompts)
    # 3. Trained here, with its validation renders, or sent to the workers (and watched).
    if app.settings.embedded:
        _train_here(app, submission, train_options.steps)
    else:
        sent = send_run(app, submission.run_id)
        if not wait:
            _report_submission(submission, sent.messages, as_json)
            return
        _watch(app, submission.run_id, train_options.steps, show=not as_json)
    _report_status(app, submission.run_id, as_json)


def _checked_options(
    app: SdqCelery,
    base: str | None,
    resume_from: tuple[int, int | None] | None,
    into: str | None,
    options: dict[str, Any],
) -> TrainOptions:
    if into is not None and ("@" in into or "/" in into):
        raise click.UsageError(f"--into {into!r}: a model name has no '@' or '/'")
    if (base is None) == (resume_from is None):
        raise click.UsageError("give --base, or --resume-from (which trains on its run's base)")
    train_options = _train_options(**options)
    if app.settings.embedded and train_options.nodes > 1:
        raise click.UsageError("--nodes spreads a run over several machines' train workers: "
                               "it needs a broker (SDQ_BROKER_URL) and workers")  # fmt: skip
    if resume_from and train_options.from_scratch:
        raise click.UsageError("--resume-from starts from trained weights; --from-scratch does not")
    return train_options


def _train_here(app: SdqCelery, submission: TrainSubmission, steps: int) -> None:
    """The run's jobs in this process, then its checkpoints' validation renders."""
    work_here(app, submission.run_id, jobs=submission.jobs,
              progress=(steps, steps_done(app, submission.run_id)))  # fmt: skip
    with app.sessions() as session:
        validations = train_lookups.validation_runs(session, submission.run_id)
    for run_id, jobs in validations:
        work_here(app, run_id, jobs=jobs)


def _train_options(
    *,
    ema: float,
    min_snr: float,
    compile_: bool,
    max_grad_norm: float,
    unet_config: str | None,
    **options: Any,
) -> TrainOptions:
    """The options as the run records them: 0 for "none" becomes None, a named or filed
    architecture its config."""
    try:
        return TrainOptions(
            ema=ema or None,
            min_snr=min_snr or None,
            compile=compile_,
            max_grad_norm=max_grad_norm or None,
            unet_config=unet_architecture(unet_config) if unet_config else None,
            **options,
        )
    except (ValueError, InvalidArchitecture) as error:
        raise click.UsageError(str(error)) from None


def _plan_request(options: TrainOptions, resolution: int, gpu_memory: int) -> dict[str, Any]:
    return {
        "unet_config": options.unet_config,
        "resolution": resolution,
        "batch_size": options.batch_size,
        "world_size": options.world_size,
        "sharding": options.sharding,
        "grad_accumulation": options.grad_accumulation,
        "mixed_precision": options.mixed_precision,
        "gradient_checkpointing": options.gradient_checkpointing,
        "ema": options.ema is not None,
        "gpu_memory": gpu_memory,
    }


def _check_job_length(options: TrainOptions, soft_limit: float) -> None:
    """A job of --checkpoint-minutes must end within the train queue's time limit, with
    room to start, restore and write its checkpoint."""
    minutes = options.checkpoint_minutes
    most = TRAINING_SHARE_OF_TIME_LIMIT * soft_limit / 60
    if minutes is not None and minutes > most:
        raise click.UsageError(
            f"--checkpoint-minutes {minutes:g} does not fit the train queue's time limit of "
            f"{soft_limit / 60:g} minutes: a job takes steps for {most:g} minutes at most "
            f"(the rest is for its start and its checkpoint); give at most {most:g}, or "
            f"raise SDQ_TRAIN_TASK_SOFT_TIME_LIMIT (and SDQ_TRAIN_TASK_TIME_LIMIT) on the "
            f"workers and here"
        )


def _check_fits(options: TrainOptions, resolution: int, gpu_memory: int) -> None:
    try:
        found = plan_memory(_plan_request(options, resolution, gpu_memory))
    except CannotPlan as error:
        raise click.UsageError(str(error)) from None
    if not found["fits"]:
        raise click.UsageError(f"this run {refusal(found)} (`sdq train plan` shows the parts)")


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
    base: str | None,
    resume_from: tuple[int, int | None] | None,
    resolution: int,
    options: TrainOptions,
    into: str | None,
    prompts: tuple[tuple[str, int], ...],
) -> TrainSubmission:
    with found():
        try:
            with app.sessions() as session:
                start_from = start_checkpoint(session, *resume_from) if resume_from else None
                if start_from is not None:
                    identity = train_lookups.run_base(session, start_from.run, store=app.store)
                else:
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
                store=app.store,
                validation=validation,
                start_from=start_from,
            )
        except (ModelNotFound, CannotTrain, InvalidArchitecture) as error:
            raise click.UsageError(str(error)) from None


def steps_done(app: SdqCelery, run_id: int) -> Callable[[], int]:
    """The run's last recorded step, asked anew at each call: what its bar counts."""

    def done() -> int:
        with app.sessions() as session:
            return train_lookups.latest_step(session, run_id)

    return done


def _watch(app: SdqCelery, run_id: int, steps: int, *, show: bool) -> None:
    """Step by step until the run closes: every job done, or the chain stopped by a dead
    job."""
    done = steps_done(app, run_id)

    def finished() -> int:
        with app.sessions() as session:
            if session.get_one(Run, run_id).finished_at is not None:
                return steps
        # Steps reach the database before their checkpoint: the last one taken is not the
        # run's end, which its closing says.
        return min(done(), steps - 1)

    watch_progress(run_id, f"train run {run_id}", steps, finished, show=show)


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
        images = train_lookups.validation_images(session, run_id)
        page = training_html(status, images, store_image_link(app.store))
        key = page_key(run_id)
        app.store.put_bytes(key, page.encode(), content_type="text/html; charset=utf-8")
        status["page"] = app.store.link(key, expires_seconds=LINK_SECONDS)
        return status

    render_command = "sdq run" if app.settings.embedded else "sdq submit"
    show = functools.partial(display.show_training, render_command=render_command)
    lookup(app, status_and_page, as_json=as_json, show=show)


@train.command()
@click.argument("run_id", type=int, metavar="RUN")
@json_option
@pass_app
def status(app: SdqCelery, run_id: int, as_json: bool) -> None:
    """Progress, ETA, the loss curve and the checkpoints of train run RUN."""
    with found():
        _report_status(app, run_id, as_json)


@train.command()
@click.option(
    "--unet-config",
    required=True,
    metavar="FILE|" + "|".join(UNET_ARCHITECTURES),
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
@WORLD_SIZE_OPTION
@SHARDING_OPTION
@GRAD_ACCUMULATION_OPTION
@MIXED_PRECISION_OPTION
@GRADIENT_CHECKPOINTING_OPTION
@EMA_OPTION
@GPU_MEMORY_OPTION
@json_option
def plan(unet_config: str, resolution: int, gpu_memory: int, as_json: bool, **options) -> None:
    """Memory per GPU (parameters, gradients, optimizer, EMA, activations) and FLOPs per
    sample of a training configuration, from its U-Net built on the meta device: nothing
    is loaded or run. Says which option would make a configuration that does not fit."""
    options["ema"] = options["ema"] or None
    try:
        architecture = unet_architecture(unet_config)
        train_options = TrainOptions(steps=1, **options)
        found = plan_memory(_plan_request(train_options, resolution, gpu_memory) | {
            "unet_config": architecture})  # fmt: skip
    except (ValueError, InvalidArchitecture, CannotPlan) as error:
        raise click.UsageError(str(error)) from None
    if as_json:
        click.echo(json.dumps(found, indent=2))
    else:
        display.show_plan(found, refusal(found) if not found["fits"] else None)


COMMANDS = (train,)
