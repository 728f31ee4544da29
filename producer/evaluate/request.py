"""What an evaluation is asked for on the command line (`sdq train --eval-metrics ...`,
`sdq evaluate`), checked before anything is written: the metrics against what they need,
the prompt file, the CLIP model."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from sdq.models.curate.clip import ClipIdentity, resolve_clip
from sdq.models.evaluate.specs import AGAINST_REAL, METRICS, RENDERED
from sdq.models.registry import ModelNotFound

# Held-out samples scored per checkpoint (and real images the renders are compared with).
DEFAULT_SAMPLES = 64


@dataclass(frozen=True)
class EvaluationRequest:
    metrics: tuple[str, ...]
    prompts: tuple[tuple[str, int], ...]  # (prompt, seed); none: held-out captions
    clip: ClipIdentity | None
    samples: int = DEFAULT_SAMPLES
    every: int = 1


def read_prompt_lines(path: Path) -> tuple[tuple[str, int], ...]:
    """A prompt file, one prompt a line (blank lines skipped), each seeded by its line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        byte = data[error.start]
        raise click.BadParameter(f"{path}:{line}: not UTF-8 text (byte {byte:#x})") from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise click.BadParameter(f"{path}:{line}: not text (a NUL byte)")
    prompts = tuple(
        (line.strip(), number)
        for number, line in enumerate(text.splitlines(), start=1)
        if line.strip()
    )
    if not prompts:
        raise click.BadParameter(f"{path}: no prompts (one prompt a line)")
    return prompts


def evaluation_request(
    metrics: str,
    *,
    prompts: Path | None,
    clip: str | None,
    holdout: float | None,
    samples: int = DEFAULT_SAMPLES,
    every: int = 1,
) -> EvaluationRequest:
    """The request, or a usage error naming what is missing (`holdout` None: the held-out
    samples come from elsewhere)."""
    names = {name.strip() for name in metrics.split(",") if name.strip()}
    if not names or names - set(METRICS):
        raise click.UsageError(f"metrics {metrics!r}: the metrics are {', '.join(METRICS)}")
    # In one order, whatever order they were asked in: the same spec, scored once.
    asked = tuple(metric for metric in METRICS if metric in names)
    needs_held_out = {"heldout_loss"} | AGAINST_REAL
    if holdout == 0 and (wanting := sorted(needs_held_out & set(asked))):
        raise click.UsageError(
            f"{', '.join(wanting)} need held-out samples (the held-out loss is measured on "
            f"them, the renders are compared with their images): give --holdout FRACTION "
            f"above 0, e.g. --holdout 0.02"
        )
    if RENDERED & set(asked) and clip is None:
        raise click.UsageError(
            f"{', '.join(sorted(RENDERED & set(asked)))} score renders with a CLIP model: give "
            f"--eval-clip MODEL (a hub id like openai/clip-vit-large-patch14, a folder or s3://)"
        )
    return EvaluationRequest(
        metrics=asked,
        prompts=read_prompt_lines(prompts) if prompts else (),
        clip=_clip(clip) if clip and RENDERED & set(asked) else None,
        samples=samples,
        every=every,
    )


def _clip(ref: str) -> ClipIdentity:
    try:
        return resolve_clip(ref)
    except ModelNotFound as error:
        raise click.UsageError(f"--eval-clip: {error}") from None


def pop_evaluation_options(options: dict[str, Any]) -> dict[str, Any]:
    """`sdq train`'s evaluation options (train_evaluation_options), taken out of the run's."""
    return {name: options.pop(f"eval_{name}") for name in EVALUATION_OPTIONS}


def train_evaluation_request(asked: dict[str, Any], holdout: float) -> EvaluationRequest | None:
    """What `sdq train`'s evaluation options ask for, or None (no --eval-metrics)."""
    if asked["metrics"] is None:
        return None
    return evaluation_request(asked["metrics"], prompts=asked["prompts"], clip=asked["clip"],
                              holdout=holdout, samples=asked["samples"],
                              every=asked["every_checkpoints"])  # fmt: skip


# The options below, by their names after `eval_`.
EVALUATION_OPTIONS = ("metrics", "prompts", "clip", "every_checkpoints", "samples")


def train_evaluation_options(command):
    """`sdq train`'s options that have its checkpoints scored."""
    options = [
        click.option(
            "--eval-metrics", metavar="METRIC[,METRIC...]",
            help=f"Score each checkpoint, on the evaluate queue, by these: {', '.join(METRICS)} "
            "(training never waits for it). heldout_loss, fd_clip and kid need --holdout.",
        ),
        click.option(
            "--eval-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="One prompt a line: what clip_score, fd_clip and kid render, with the same "
            "seeds at every checkpoint. [default: the held-out samples' captions]",
        ),
        click.option(
            "--eval-clip", metavar="MODEL",
            help="The CLIP model renders are scored by: a hub id like "
            "openai/clip-vit-large-patch14, a folder or s3://.",
        ),
        click.option(
            "--eval-every-checkpoints", default=1, show_default=True, type=click.IntRange(min=1),
            help="Score every K-th checkpoint, and the last.",
        ),
        click.option(
            "--eval-samples", default=DEFAULT_SAMPLES, show_default=True,
            type=click.IntRange(min=2),
            help="Held-out samples each evaluation reads: the held-out loss's, and the real "
            "images the renders are compared with.",
        ),
    ]  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command
