"""The download commands: turn URL lists into a dataset, and look at datasets."""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import click
from sqlalchemy.orm import Session

from sdq.models.datasets import (
    BLOCKED_ADDRESS,
    IMAGE_FORMATS,
    RESIZE_MODES,
    ImageOptions,
    ListColumns,
    check_name,
)
from sdq.models.store import LINK_SECONDS, StoreError
from sdq.producer import display
from sdq.producer.cli.common import (
    carry_out,
    found,
    json_option,
    lookup,
    pass_app,
    ready_to_submit,
    report_submission,
    table,
)
from sdq.producer.download import lookups as dataset_lookups
from sdq.producer.download.page import dataset_html, first_samples, page_key
from sdq.workers.app import SdqCelery

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
    "no: as downloaded.",
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
        if lists or name:
            raise click.UsageError("--retry-failed NAME takes no LIST and no --dataset")
        from sdq.producer.download.submit import record_retry

        with found():
            submission = record_retry(app.sessions, retry_name, reasons)
    else:
        if not (lists and name):
            raise click.UsageError("give LIST... and --dataset NAME, or --retry-failed NAME")
        if reasons:
            raise click.UsageError("--reason goes with --retry-failed NAME")
        columns = ListColumns(
            url=url_col,
            caption=caption_col,
            save=tuple(column.strip() for column in save_columns.split(",") if column.strip()),
        )
        submission = _submit(app, name, lists, columns, _options(name, image, rows_per_shard))
    carry_out_dataset_run(
        app,
        submission,
        wait=wait,
        as_json=as_json,
        report_sent=lambda tasks: _report_submission(submission, tasks, as_json),
    )


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


class DatasetSubmission(Protocol):
    """A recorded run that adds to a dataset (downloaded samples or their latents)."""

    run_id: int
    dataset: str
    jobs: int
    cached: int


def carry_out_dataset_run(
    app: SdqCelery,
    submission: DatasetSubmission,
    *,
    wait: bool,
    as_json: bool,
    report_sent: Callable[[int], None],
) -> None:
    """Does or sends a run that adds to a dataset: reports what was sent (given the number
    of task messages) when the run is left to the workers, else the dataset as it now is."""
    sent = carry_out(
        app,
        submission.run_id,
        jobs=submission.jobs,
        wait=wait,
        as_json=as_json,
    )
    if sent:
        report_sent(sent.messages)
    else:
        report_dataset(app, submission.dataset, as_json)


def report_dataset(app: SdqCelery, name: str, as_json: bool) -> None:
    summary = lookup(
        app,
        lambda session: dataset_lookups.dataset_summary(session, name),
        as_json=as_json,
        show=display.show_dataset,
    )
    if blocked := summary["reasons"].get(BLOCKED_ADDRESS):
        display.hint(_blocked_hint(app, name, blocked, summary))


def _blocked_hint(app: SdqCelery, name: str, blocked: int, summary: dict[str, Any]) -> str:
    """What refused the blocked hosts and where to open their network: the setting is read
    where the fetching happens, in this process without a broker, else on the CPU workers,
    where setting it in the submitting shell changes nothing."""
    opened = ", ".join(summary["blocked_by"]) or "none"
    if app.settings.embedded:
        where = (
            f"it opened {opened} where they were fetched (here, without a broker). If they "
            "are yours to fetch (an internal mirror), set it to their networks (CIDRs) in "
            "this shell"
        )
    else:
        where = (
            f"it opened {opened} on the CPU workers that fetched them. If they are yours to "
            "fetch (an internal mirror), set it to their networks (CIDRs) where the CPU "
            "workers run (`sdq worker cpu`) and restart them: they fetch, not this shell"
        )
    return (
        f"{blocked} of {summary['samples']} samples were not fetched: their hosts are "
        f"private, loopback, link-local or reserved addresses, which sdq refuses unless "
        f"SDQ_DOWNLOAD_ALLOW_NETWORKS opens them; {where}; then run "
        f'`sdq download --retry-failed {name} --reason "{BLOCKED_ADDRESS}"`.'
    )


@click.group()
def dataset() -> None:
    """Datasets made by `sdq download`: what they hold, what failed and why."""


@dataset.command("list")
@json_option
@pass_app
def list_command(app: SdqCelery, as_json: bool) -> None:
    """Every dataset, with its shards and samples."""
    lookup(
        app,
        dataset_lookups.list_datasets,
        as_json=as_json,
        show=table(["name", "created_at", "shards", "samples", "ok"]),
    )


@dataset.command()
@click.argument("name")
@json_option
@pass_app
def show(app: SdqCelery, name: str, as_json: bool) -> None:
    """Samples by status, failure reasons with counts, shards, bytes, images/s; and the
    dataset's page, written into the store (datasets/NAME/index.html), with its first
    samples and their captions."""

    def summary_and_page(session: Session) -> dict[str, Any]:
        summary = dataset_lookups.dataset_summary(session, name)
        try:
            page = dataset_html(summary, first_samples(app.store, summary)).encode()
            key = page_key(name)
            app.store.put_bytes(key, page, content_type="text/html; charset=utf-8")
        except StoreError as error:
            raise click.ClickException(str(error)) from None
        return {**summary, "page": app.store.link(key, expires_seconds=LINK_SECONDS)}

    lookup(app, summary_and_page, as_json=as_json, show=display.show_dataset)


COMMANDS = (download, dataset)
