"""The curate commands: `sdq curate`, every kept sample of a dataset scored by CLIP (its
image against its caption), an aesthetic head and an NSFW head, on the GPU workers; and
`sdq dataset filter`, a new dataset of the samples that pass rules on those scores, without
near-duplicates."""

import tempfile
from pathlib import Path

import click

from sdq.models import tiny
from sdq.models.curate.clip import resolve_clip
from sdq.models.datasets import check_name
from sdq.models.registry import ModelNotFound
from sdq.producer.cli.common import (
    found,
    json_option,
    pass_app,
    ready_to_submit,
    report_submission,
)
from sdq.producer.curate.filter import CannotFilter, FilterSubmission, Rules, record_filter
from sdq.producer.curate.submit import (
    CannotCurate,
    CurateSubmission,
    Heads,
    checked_head,
    curatable,
    record_curate,
    store_head,
    tiny_head,
)
from sdq.producer.datasets.cli import carry_out_dataset_run, report_dataset
from sdq.producer.datasets.lookups import NotReadable
from sdq.workers.app import SdqCelery


class HeadFile(click.Path):
    """A head's file (a Path), or `tiny` (the string: built here)."""

    def __init__(self) -> None:
        super().__init__(exists=True, dir_okay=False, path_type=Path)

    def convert(self, value, param, ctx):
        return value if value == tiny.TINY_NAME else super().convert(value, param, ctx)


HEAD_FILE = HeadFile()


@click.command()
@click.argument("name")
@click.option(
    "--model",
    required=True,
    help="The CLIP model: a transformers CLIPModel folder, s3://... or a hub id "
    "(openai/clip-vit-large-patch14); `tiny`, a small random-weight one built here, runs "
    "the chain without a download (its scores mean nothing).",
)
@click.option(
    "--aesthetic-head",
    type=HEAD_FILE,
    help="LAION's improved aesthetic predictor for this CLIP (a .pth or .safetensors state "
    "dict, as published): an aesthetic score, about 1 to 10, per image. `tiny`: random "
    "weights of its layout built here (scores that mean nothing, no download).",
)
@click.option(
    "--nsfw-head",
    type=HEAD_FILE,
    help="An NSFW detector on this CLIP's embedding (linear layers, ReLU between, a "
    "sigmoid at the end, as a state dict): a probability per image. `tiny`: one built here.",
)
@click.option(
    "--batch-size", default=64, show_default=True, type=click.IntRange(min=1),
    help="Images per CLIP call.",
)  # fmt: skip
@click.option("--wait", is_flag=True, help="Show progress until every shard is scored.")
@json_option
@pass_app
def curate(
    app: SdqCelery,
    name: str,
    model: str,
    aesthetic_head: Path | str | None,
    nsfw_head: Path | str | None,
    batch_size: int,
    wait: bool,
    as_json: bool,
) -> None:
    """Score dataset NAME's kept samples, one job per image shard on the GPU workers: each
    image's CLIP embedding (stored beside the images), its CLIP score against its caption
    (100 x cosine, as torchmetrics' CLIPScore), and the heads' scores. The SQL view
    sample_quality shows them by sample.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    ready_to_submit(app)
    submission = _submit(app, name, model, {"--aesthetic-head": aesthetic_head,
                                            "--nsfw-head": nsfw_head}, batch_size)  # fmt: skip
    carry_out_dataset_run(
        app,
        submission,
        wait=wait,
        as_json=as_json,
        report_sent=lambda tasks: _report_submission(submission, tasks, as_json),
    )


def _submit(
    app: SdqCelery, name: str, model: str, heads: dict[str, Path | str | None], batch_size: int
) -> CurateSubmission:
    """Everything checked before anything is written: the model, the heads against it, the
    dataset; then the heads stored and the run recorded."""
    with found(), tempfile.TemporaryDirectory(prefix="sdq-heads-") as folder:
        try:
            clip = resolve_clip(model)
            heads = {option: tiny_head(option, clip, Path(folder)) if path == tiny.TINY_NAME
                     else path for option, path in heads.items()}  # fmt: skip
            for option, path in heads.items():
                if path is not None:
                    checked_head(path, option, clip)
            with app.sessions() as session:
                curatable(session, name)  # before the heads are stored
            return record_curate(app.sessions, name, clip, _stored(app, heads), batch_size)
        except (ModelNotFound, CannotCurate, NotReadable) as error:
            raise click.UsageError(str(error)) from None


def _stored(app: SdqCelery, heads: dict[str, Path | None]) -> Heads:
    aesthetic, nsfw = heads["--aesthetic-head"], heads["--nsfw-head"]
    return Heads(
        aesthetic=store_head(app.store, aesthetic) if aesthetic else None,
        nsfw=store_head(app.store, nsfw) if nsfw else None,
    )


def _report_submission(submission: CurateSubmission, tasks: int, as_json: bool) -> None:
    waiting = f"; {submission.waiting} not downloaded yet" if submission.waiting else ""
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "model": submission.model,
            "revision": submission.revision,
            "jobs": submission.jobs,
            "cached": submission.cached,
            "waiting": submission.waiting,
            "tasks": tasks,
        },
        f"{submission.jobs} shards to score, {submission.cached} done before{waiting}; "
        f"`sdq dataset show {submission.dataset}` follows it",
        as_json=as_json,
    )


@click.command("filter")
@click.argument("name")
@click.option(
    "--into",
    "into",
    required=True,
    metavar="NEW",
    help="The new dataset: NAME's kept samples that pass, with no image copied.",
)
@click.option(
    "--min-clip-score",
    type=click.FloatRange(0, 100),
    help="Leave out samples whose CLIP score (100 x cosine) is under this.",
)
@click.option(
    "--min-aesthetic",
    type=float,
    help="Leave out samples whose aesthetic score is under this (LAION's predictor scores "
    "about 1 to 10; `sdq dataset show` gives the dataset's range).",
)
@click.option(
    "--max-nsfw",
    type=click.FloatRange(0, 1),
    help="Leave out samples whose NSFW probability is over this.",
)
@click.option(
    "--min-size",
    type=click.IntRange(min=1),
    metavar="PX",
    help="Leave out images whose original width or height is under PX.",
)
@click.option(
    "--dedup",
    type=click.FloatRange(0, 1, min_open=True),
    metavar="COSINE",
    help="Leave out near-duplicates: of samples whose CLIP image embeddings have "
    "this cosine or more, keep the best-scoring (aesthetic, else CLIP score).",
)
@click.option(
    "--dedup-clusters",
    type=click.IntRange(min=0),
    metavar="K",
    help="Find near-duplicates within K k-means clusters, a job each (0: all in one "
    "job). By default one job up to 50,000 samples, else clusters of about 10,000.",
)
@click.option("--wait", is_flag=True, help="Show progress until the near-duplicates are out.")
@json_option
@pass_app
def filter_command(
    app: SdqCelery, name: str, into: str, wait: bool, as_json: bool, **rules: float | int | None
) -> None:
    """A new dataset NEW of dataset NAME's kept samples that pass the rules given, scored by
    `sdq curate NAME`. No image is copied: NEW's shards are NAME's files, restricted to its
    members. Every sample left out keeps its reason (`aesthetic 3.92 < 5`, `near-duplicate of
    KEY (cosine 0.97)`) in SQL: the view sample_quality, dataset NEW.

    Near-duplicates are found by jobs on the curate queue; without a broker (SDQ_BROKER_URL
    unset) the work runs here, in this process. `sdq encode NEW` and `sdq train NEW` take
    the dataset once they are done."""
    ready_to_submit(app)
    submission = _filter(app, name, into, Rules(**rules))
    if submission.run_id is None:
        report_dataset(app, into, as_json)
        return
    carry_out_dataset_run(
        app,
        submission,
        wait=wait,
        as_json=as_json,
        report_sent=lambda tasks: _report_filter(submission, tasks, as_json),
    )


def _filter(app: SdqCelery, name: str, into: str, rules: Rules) -> FilterSubmission:
    if not rules.to_dict().keys() - {"dedup_clusters"}:
        raise click.UsageError(
            "give at least one rule: --min-clip-score, --min-aesthetic, "
            "--max-nsfw, --min-size or --dedup"
        )
    if rules.dedup_clusters is not None and rules.dedup is None:
        raise click.UsageError("--dedup-clusters goes with --dedup COSINE")
    try:
        check_name(into)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--into") from None
    with found():
        try:
            return record_filter(app.sessions, name, into, rules)
        except CannotFilter as error:
            raise click.UsageError(str(error)) from None


def _report_filter(submission: FilterSubmission, tasks: int, as_json: bool) -> None:
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "parent": submission.parent,
            "samples": submission.samples,
            "kept": submission.kept,
            "removed": submission.removed,
            "jobs": submission.jobs,
            "tasks": tasks,
        },
        f"{submission.kept} of {submission.samples} samples kept by the score rules; "
        f"near-duplicates next ({submission.jobs} job(s)); `sdq dataset show "
        f"{submission.dataset}` follows it",
        as_json=as_json,
    )


COMMANDS = (curate,)
