"""The dataset commands (`sdq dataset list|show`), and how a run that adds to a dataset
(downloaded samples, their latents) is carried out and reported."""

from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import click
from sqlalchemy.orm import Session

from sdq.models.datasets import BLOCKED_ADDRESS
from sdq.models.jobs.kinds import KINDS
from sdq.models.store import LINK_SECONDS, ObjectStore, StoreError
from sdq.producer import display
from sdq.producer.cli.common import exit_if_dead, json_option, lookup, pass_app, table
from sdq.producer.cli.here import carry_out
from sdq.producer.datasets import lookups as dataset_lookups
from sdq.producer.datasets.page import (
    dataset_html,
    first_samples,
    page_key,
)
from sdq.workers.app import SdqCelery


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
) -> bool:
    """Does or sends a run that adds to a dataset: reports what was sent (given the number
    of task messages) when the run is left to the workers, else the dataset as it now is.
    True when the run ended here (done, or waited for)."""
    sent = carry_out(
        app,
        submission.run_id,
        jobs=submission.jobs,
        wait=wait,
        as_json=as_json,
    )
    if sent:
        report_sent(sent.messages)
        return False
    report_dataset(app, submission.dataset, as_json)
    exit_if_dead(app, submission.run_id)
    return True


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
            kept = partial(dataset_lookups.kept_keys, session, name)
            samples = first_samples(app.store, summary, kept)
            sections = [section(summary, app.store) for section in kind_pages()]
            page = dataset_html(summary, samples, "\n".join(sections)).encode()
            key = page_key(name)
            app.store.put_bytes(key, page, content_type="text/html; charset=utf-8")
        except StoreError as error:
            raise click.ClickException(str(error)) from None
        return {**summary, "page": app.store.link(key, expires_seconds=LINK_SECONDS)}

    lookup(app, summary_and_page, as_json=as_json, show=display.show_dataset)


def kind_pages() -> list[Callable[[dict[str, Any], ObjectStore], str]]:
    """The kinds' sections of a dataset's page (ProducerHooks.dataset_page)."""
    return [page for kind in KINDS.values() if (page := kind.producer_hooks().dataset_page)]


COMMANDS = (dataset,)
