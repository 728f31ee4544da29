"""The download command: turn URL lists into a dataset (producer/datasets/ looks at them)."""

import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import click

from sdq.models.datasets import IMAGE_FORMATS, RESIZE_MODES, ImageOptions, ListColumns, check_name
from sdq.producer.cli.common import (
    found,
    json_option,
    pass_app,
    ready_to_submit,
    report_submission,
)
from sdq.producer.datasets.cli import carry_out_dataset_run
from sdq.producer.download.lookups import fetched_of
from sdq.workers.app import SdqCelery

NOTHING_FETCHED = 1  # the exit status of a download that fetched none of its rows

# The list reading and its planning (producer/download/lists.py) stand on pyarrow, whose
# import, numpy's with it, is a tenth of a second of every `sdq` command's start: they are
# imported by the commands that use them.
if TYPE_CHECKING:
    from sdq.producer.download.submit import DatasetOptions, DownloadSubmission


@click.command()
@click.argument("lists", nargs=-1, metavar="LIST...")
@click.option("--dataset", "name", help="The dataset to make or add to.")
@click.option(
    "--retry-failed",
    "retry_name",
    metavar="NAME",
    help="Fetch again only the samples of dataset NAME that failed for a reason that may "
    "have passed (timeouts, connection failures, 429, 5xx); no LIST.",
)
@click.option(
    "--reason",
    "reasons",
    multiple=True,
    metavar="REASON",
    help="With --retry-failed: fetch again the samples that failed for REASON instead, e.g. "
    '"blocked address" once SDQ_DOWNLOAD_ALLOW_NETWORKS opens their network (repeatable).',
)
@click.option("--url-col", default="url", show_default=True, help="The column of image URLs.")
@click.option("--caption-col", default="caption", show_default=True, help="The captions.")
@click.option(
    "--resolution",
    default=256,
    show_default=True,
    type=click.IntRange(min=8),
    help="Side of the images kept, in pixels.",
)
@click.option(
    "--resize-mode",
    type=click.Choice(RESIZE_MODES),
    default="center_crop",
    show_default=True,
    help="center_crop: the centre square; border: the whole "
    "image, padded to a square; keep_ratio: the shorter side at --resolution; "
    "keep_ratio_largest: the longer side at it (what aspect-ratio buckets need, with no "
    "image larger than it); no: as downloaded.",
)
@click.option(
    "--format",
    "image_format",
    type=click.Choice(IMAGE_FORMATS),
    default="jpg",
    show_default=True,
    help="How the images are stored in the shards.",
)
@click.option(
    "--quality",
    default=95,
    show_default=True,
    type=click.IntRange(1, 100),
    help="JPEG or WebP quality of the stored images.",
)
@click.option(
    "--rows-per-shard",
    default=1000,
    show_default=True,
    type=click.IntRange(min=1),
    help="List rows per download job and per parquet shard.",
)
@click.option(
    "--min-size",
    default=64,
    show_default=True,
    type=click.IntRange(min=0),
    help="Images with a smaller side (before resizing) are refused.",
)
@click.option(
    "--save-columns", default="", metavar="A,B", help="Further list columns copied into the shards."
)
@click.option("--wait", is_flag=True, help="Show progress until every shard is done.")
@json_option
@pass_app
def download(
    app: SdqCelery,
    lists: tuple[str, ...],
    name: str | None,
    retry_name: str | None,
    reasons: tuple[str, ...],
    url_col: str,
    caption_col: str,
    rows_per_shard: int,
    save_columns: str,
    wait: bool,
    as_json: bool,
    **image: Any,
) -> None:
    """Download the images of URL + caption lists (parquet, CSV, TSV or JSON lines, local
    or s3://) into a dataset of parquet shards, each sample's fate recorded.

    URLs whose host is a private, loopback, link-local or reserved address are refused
    ("blocked address"): SDQ_DOWNLOAD_ALLOW_NETWORKS=CIDR,... opens named networks (an
    internal mirror), and `--retry-failed NAME --reason "blocked address"` fetches those
    rows again.

    Without a broker (SDQ_BROKER_URL unset) the work runs here, in this process."""
    ready_to_submit(app)
    if retry_name:
        submission = _retry(app, retry_name, reasons, given=bool(lists or name))
    else:
        if not (lists and name):
            raise click.UsageError("give LIST... and --dataset NAME, or --retry-failed NAME")
        if reasons:
            raise click.UsageError("--reason goes with --retry-failed NAME")
        columns = _columns(url_col, caption_col, save_columns)
        submission = _submit(app, name, lists, columns, _options(name, image, rows_per_shard))
    report_sent = partial(_report_submission, submission, as_json=as_json)
    if carry_out_dataset_run(app, submission, wait=wait, as_json=as_json, report_sent=report_sent):
        _exit_if_none_fetched(app, submission)


def _exit_if_none_fetched(app: SdqCelery, submission: "DownloadSubmission") -> None:
    """A download that fetched none of its rows failed, whatever its jobs did (each one
    ended, recording why every row failed): a script sees it."""
    with app.sessions() as session:
        fetched, rows = fetched_of(session, submission.run_id)
    if rows and not fetched:
        click.echo(f"none of the {rows} rows was fetched; why: `sdq dataset show "
                   f"{submission.dataset}`", err=True)  # fmt: skip
        sys.exit(NOTHING_FETCHED)


def _columns(url: str, caption: str, save: str) -> ListColumns:
    """The list's columns to read, and those saved beside each image (comma-separated)."""
    saved = tuple(column.strip() for column in save.split(",") if column.strip())
    return ListColumns(url=url, caption=caption, save=saved)


def _retry(
    app: SdqCelery, name: str, reasons: tuple[str, ...], *, given: bool
) -> "DownloadSubmission":
    """`--retry-failed NAME`: the dataset's failed rows (of these reasons) fetched again."""
    if given:
        raise click.UsageError("--retry-failed NAME takes no LIST and no --dataset")
    from sdq.producer.download.submit import record_retry

    with found():
        return record_retry(app.sessions, name, reasons)


def _options(name: str, image: dict[str, Any], rows_per_shard: int) -> "DatasetOptions":
    from sdq.producer.download.submit import DatasetOptions

    try:
        check_name(name)
        return DatasetOptions(
            ImageOptions(format=image.pop("image_format"), **image), rows_per_shard
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def _submit(
    app: SdqCelery,
    name: str,
    lists: tuple[str, ...],
    columns: ListColumns,
    options: "DatasetOptions",
) -> "DownloadSubmission":
    from sdq.producer.download.lists import ListError, plan_list
    from sdq.producer.download.submit import DatasetMismatch, record_download

    try:
        planned = [
            plan_list(
                location,
                columns,
                store=app.store,
                dataset=name,
                rows_per_shard=options.rows_per_shard,
            )
            for location in lists
        ]
        return record_download(app.sessions, name, planned, columns=columns, options=options)
    except (ListError, DatasetMismatch) as error:
        raise click.UsageError(str(error)) from None


def _report_submission(submission: "DownloadSubmission", tasks: int, as_json: bool) -> None:
    report_submission(
        {
            "run_id": submission.run_id,
            "dataset": submission.dataset,
            "jobs": submission.jobs,
            "cached": submission.cached,
            "tasks": tasks,
        },
        f"{submission.jobs} shards to download, {submission.cached} done before; "
        f"`sdq dataset show {submission.dataset}` follows it",
        as_json=as_json,
    )


COMMANDS = (download,)
