"""What an evaluation is asked for on the command line (`sdq train --eval-metrics ...`,
`sdq evaluate`), checked before anything is written: the metrics against what they need,
the prompt file, the CLIP model, FID's Inception weights."""

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import click

from sdq.models.curate.clip import ClipIdentity, resolve_clip
from sdq.models.evaluate.specs import AGAINST_REAL, CLIP_SCORED, METRICS, FidWeights
from sdq.models.registry import ModelNotFound, file_sha256
from sdq.models.store import MissingObject, S3Store
from sdq.producer.cli.common import exit_bad_input
from sdq.producer.errors import InvalidInput
from sdq.producer.prompts import is_prompt_file_header, seeded_prompts

# Held-out samples scored per checkpoint (and real images the renders are compared with).
DEFAULT_SAMPLES = 64


@dataclass(frozen=True)
class EvaluationRequest:
    metrics: tuple[str, ...]
    prompts: tuple[tuple[str, int], ...]  # (prompt, seed); none: held-out captions
    clip: ClipIdentity | None
    samples: int = DEFAULT_SAMPLES
    every: int = 1
    fid_weights: FidWeights | None = None
    dataset: str | None = None  # a dataset of its own to evaluate on (--eval-dataset)


def read_seeded_prompts(path: Path) -> tuple[tuple[str, int], ...]:
    """A prompt file as `sdq run` reads it, each prompt with its seed (seeded_prompts); its
    problems end the command, naming file, line and field."""
    try:
        return seeded_prompts(path)
    except InvalidInput as problems:
        exit_bad_input(problems)


def read_prompt_lines(path: Path, option: str) -> tuple[tuple[str, int], ...]:
    """A prompt file, one prompt a line (blank lines skipped), each seeded by its line; or
    one with a header, as `sdq run` and `--validation-prompts` read it (seeds its own)."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # without the BOM a spreadsheet's export begins with
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        byte = data[error.start]
        raise click.BadParameter(f"{path}:{line}: not UTF-8 text (byte {byte:#x})",
                                 param_hint=option) from None  # fmt: skip
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise click.BadParameter(f"{path}:{line}: not text (a NUL byte)", param_hint=option)
    lines = [(number, line.strip()) for number, line in enumerate(text.splitlines(), start=1)]
    prompts = tuple((line, number) for number, line in lines if line)
    if prompts and is_prompt_file_header(prompts[0][0]):
        return read_seeded_prompts(path)
    if not prompts:
        raise click.BadParameter(f"{path}: no prompts (one prompt a line)", param_hint=option)
    return prompts


def evaluation_request(
    metrics: str,
    *,
    prompts: Path | None,
    clip: str | None,
    holdout: float | None,
    fid_weights: str | FidWeights | None = None,
    samples: int = DEFAULT_SAMPLES,
    every: int = 1,
    flags: str = "--",
) -> EvaluationRequest:
    """The request, or a usage error naming what is missing (`holdout` None: the held-out
    samples come from elsewhere; `fid_weights` as given, or as a run recorded them), the
    options by the command's own names (`flags`: `--eval-` for sdq train's)."""
    names = {name.strip() for name in metrics.split(",") if name.strip()}
    if not names or names - set(METRICS):
        raise click.UsageError(f"metrics {metrics!r}: the metrics are {', '.join(METRICS)}")
    # In one order, whatever order they were asked in: the same spec, scored once.
    asked = tuple(metric for metric in METRICS if metric in names)
    _check_needs(set(asked), holdout=holdout, clip=clip, fid_weights=fid_weights,
                 clip_flag=f"{flags}clip")  # fmt: skip
    return EvaluationRequest(
        metrics=asked,
        prompts=read_prompt_lines(prompts, f"{flags}prompts") if prompts else (),
        clip=_clip(clip) if clip and CLIP_SCORED & set(asked) else None,
        samples=samples,
        every=every,
        fid_weights=resolve_fid_weights(fid_weights)
        if isinstance(fid_weights, str)
        else fid_weights,
    )


def _check_needs(
    asked: set[str], *, holdout: float | None, clip: str | None, fid_weights: object,
    clip_flag: str,
) -> None:  # fmt: skip
    """Refuses metrics without what they are computed from."""
    if holdout == 0 and (wanting := sorted(({"heldout_loss"} | AGAINST_REAL) & asked)):
        raise click.UsageError(
            f"{', '.join(wanting)} need held-out samples (the held-out loss is measured on "
            f"them, the renders are compared with their images): give --holdout FRACTION "
            f"above 0, e.g. --holdout 0.02, or a dataset to score on (--eval-dataset NAME)"
        )
    if CLIP_SCORED & asked and clip is None:
        scored = sorted(CLIP_SCORED & asked)
        raise click.UsageError(
            f"{', '.join(scored)} {'need' if len(scored) > 1 else 'needs'} a CLIP model to "
            f"score renders with: give {clip_flag} MODEL (a hub id like "
            f"openai/clip-vit-large-patch14, a folder, s3://, or tiny: random weights, to try "
            f"it out)"
        )
    if ("fid" in asked) != (fid_weights is not None):
        raise click.UsageError(
            "fid is computed on Inception-v3 with the weights torchmetrics and torch-fidelity "
            "use: give --fid-weights FILE|s3:// (weights-inception-2015-12-05-6726825d.pth), "
            "and only with fid among the metrics"
        )


def _clip(ref: str) -> ClipIdentity:
    try:
        return resolve_clip(ref)
    except ModelNotFound as error:
        raise click.UsageError(f"--eval-clip: {error}") from None


# What torch.save writes: a zip archive, or (before torch 1.6) a pickle.
TORCH_FILE_MAGIC = (b"PK\x03\x04", b"\x80")


def resolve_fid_weights(ref: str) -> FidWeights:
    """The Inception weights file as a spec names it: where it is and its content."""
    if ref.startswith("s3://"):
        bucket, _, key = ref.removeprefix("s3://").partition("/")
        try:
            data = S3Store(bucket).get_bytes(key)
        except MissingObject:
            raise click.UsageError(f"--fid-weights: no object {ref}") from None
        head, sha256, source = data[:4], hashlib.sha256(data).hexdigest(), ref
    else:
        path = Path(ref)
        if not path.is_file():
            raise click.UsageError(f"--fid-weights: no file {path.absolute()}")
        with path.open("rb") as handle:
            head = handle.read(4)
        sha256, source = file_sha256(path), str(path.resolve())
    if not head.startswith(TORCH_FILE_MAGIC):
        raise click.UsageError(
            f"--fid-weights: {ref} is not a PyTorch weights file (what torch.save writes)"
        )
    return FidWeights(source=source, sha256=sha256)


def pop_evaluation_options(options: dict[str, Any]) -> dict[str, Any]:
    """`sdq train`'s evaluation options (train_evaluation_options), taken out of the run's."""
    return {name: options.pop(f"eval_{name}") for name in EVALUATION_OPTIONS}


def train_evaluation_request(asked: dict[str, Any], holdout: float) -> EvaluationRequest | None:
    """What `sdq train`'s evaluation options ask for, or None (no --eval-metrics)."""
    if asked["metrics"] is None:
        if asked["dataset"] is not None:
            raise click.UsageError("--eval-dataset: give the metrics too (--eval-metrics)")
        return None
    if asked["dataset"] is not None and holdout:
        raise click.UsageError(
            f"--eval-dataset {asked['dataset']} is what the checkpoints are scored on: "
            f"--holdout {holdout:g} would hold out samples that nothing scores; give one"
        )
    request = evaluation_request(asked["metrics"], prompts=asked["prompts"], clip=asked["clip"],
                                 holdout=None if asked["dataset"] else holdout,
                                 fid_weights=asked["fid_weights"], samples=asked["samples"],
                                 every=asked["every_checkpoints"],
                                 flags="--eval-")  # fmt: skip
    return replace(request, dataset=asked["dataset"])


# The options below, by their names after `eval_`.
EVALUATION_OPTIONS = ("metrics", "prompts", "clip", "fid_weights", "every_checkpoints", "samples",
                      "dataset")  # fmt: skip


# `sdq train`'s options that have its checkpoints scored.
TRAIN_EVALUATION_OPTIONS = (
    click.option(
        "--eval-metrics", metavar="METRIC[,METRIC...]",
        help=f"Score each checkpoint, on the evaluate queue, by these: {', '.join(METRICS)} "
        "(training never waits for it). heldout_loss, fd_clip, kid and fid need "
        "--holdout or --eval-dataset.",
    ),
    click.option(
        "--eval-prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="One prompt a line (or a prompt file with a header, as sdq run reads it): what "
        "clip_score, fd_clip, kid and fid render, with the same "
        "seeds at every checkpoint. [default: the held-out samples' captions]",
    ),
    click.option(
        "--eval-clip", metavar="MODEL",
        help="The CLIP model renders are scored by: a hub id like "
        "openai/clip-vit-large-patch14, a folder, s3://, or tiny (random weights, to try it "
        "out).",
    ),
    click.option(
        "--eval-fid-weights", "--fid-weights", "eval_fid_weights", metavar="FILE|s3://",
        help="Inception-v3's weights for fid, as torchmetrics and torch-fidelity load them "
        "(weights-inception-2015-12-05-6726825d.pth).",
    ),
    click.option(
        "--eval-dataset", metavar="NAME",
        help="Score on this dataset's samples instead of held-out ones (its latents "
        "encoded with the run's model at its resolution; its first --eval-samples).",
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
)  # fmt: skip


def train_evaluation_options(command):
    """`sdq train`'s options that have its checkpoints scored."""
    for option in reversed(TRAIN_EVALUATION_OPTIONS):
        command = option(command)
    return command
