"""What `sdq train` refuses before anything is written: options that do not go together,
a job too long for its queue's time limit, and a tracker missing where the run trains."""

import importlib.util
from typing import Any

import click

from sdq.models.train.architectures import InvalidArchitecture, unet_architecture
from sdq.models.train.specs import TRAINING_SHARE_OF_TIME_LIMIT, TrainOptions
from sdq.producer.cli.options import from_command_line
from sdq.producer.evaluate.request import EvaluationRequest
from sdq.workers.app import SdqCelery


def checked_options(
    app: SdqCelery,
    base: str | None,
    resume_from: tuple[int, int | str | None] | None,
    options: dict[str, Any],
) -> TrainOptions:
    if (base is None) == (resume_from is None):
        raise click.UsageError("give --base, or --resume-from (which trains on its run's base)")
    train_options = _train_options(**options)
    if app.settings.embedded and train_options.nodes > 1:
        raise click.UsageError("--nodes spreads a run over several machines' train workers: "
                               "it needs a broker (SDQ_BROKER_URL) and workers")  # fmt: skip
    if resume_from and train_options.from_scratch:
        raise click.UsageError("--resume-from starts from trained weights; --from-scratch does not")
    if resume_from and train_options.lora:
        raise click.UsageError("--lora-rank trains adapters over a base model: to adapt a "
                               "checkpoint's model, give it as --base RUN@STEP")  # fmt: skip
    return train_options


def check_evaluation(options: TrainOptions, evaluation: EvaluationRequest | None) -> None:
    """Evaluation scores a checkpoint's whole pipeline, and a LoRA run's models are LoRA
    files."""
    if evaluation is not None and options.lora:
        raise click.UsageError(
            "--eval-metrics scores a checkpoint's whole model, and a LoRA run's models are "
            "LoRA files: leave --eval-metrics out, and compare them by rendering with "
            "--lora NAME@STEP (--validation-prompts renders them at every checkpoint)"
        )


def _train_options(unet_config: str | None, **options: Any) -> TrainOptions:
    """The options as the run records them: 0 for "none" becomes None (as declared), a named
    or filed architecture its config."""
    try:
        return TrainOptions(
            unet_config=unet_architecture(unet_config) if unet_config else None,
            **from_command_line(TrainOptions, options),
        )
    except (ValueError, InvalidArchitecture) as error:
        raise click.UsageError(str(error)) from None


def check_trackers(app: SdqCelery, report_to: tuple[str, ...]) -> None:
    """Without a broker this process trains and sends the figures: a tracker's library
    missing here is refused before anything runs (on the services, the workers need it)."""
    missing = [tracker for tracker in report_to if importlib.util.find_spec(tracker) is None]
    if app.settings.embedded and missing:
        raise click.UsageError(
            f"--report-to {missing[0]}: {missing[0]} is not installed here, where the run "
            f"trains: pip install 'sdq[trackers]'"
        )


def check_job_length(options: TrainOptions, soft_limit: float) -> None:
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
