"""What people see: progress bars while work runs, tables when it is done."""

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from sdq.models.datasets import SampleStatus
from sdq.models.jobs.kinds import KINDS
from sdq.models.periodic import every
from sdq.producer.lookups import PLANNED

console = Console(stderr=True)
stdout = Console()


def hint(text: str) -> None:
    """What a person should know or do next, on stderr: JSON on stdout stays clean."""
    console.print(f"[yellow]{text}[/yellow]", highlight=False)


def print_json(data: Any) -> None:
    # Plain print: rich would wrap long lines and break the JSON for other programs.
    print(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def showing_progress(as_json: bool) -> bool:
    """Live bars are for a person at a terminal: not for a script reading JSON or a log."""
    return console.is_terminal and not as_json


@contextmanager
def counting(
    title: str, *, total: int | None = None, show: bool = True
) -> Iterator[Callable[[int], None]]:
    """A bar, or with no total a running count, that the body advances by calling what it
    is given: for work this process does itself, such as writing a million-job run."""
    count = MofNCompleteColumn() if total else TextColumn("{task.completed:,}")
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), count, TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not show) as bar:
        task = bar.add_task(title, total=total)
        yield lambda done: bar.advance(task, done)


@contextmanager
def _tracking(title: str, total: int, show: bool) -> Iterator[Callable[[int], None]]:
    """A bar against `total` (drawn if `show`), set to the count it is given."""
    with progress() as bar:
        bar.disable = not show
        task = bar.add_task(title, total=total)
        yield lambda count: bar.update(task, completed=count)


@contextmanager
def following(
    title: str,
    total: int,
    finished: Callable[[], int],
    *,
    show: bool = True,
    poll_seconds: float = 0.5,
) -> Iterator[None]:
    """While the body runs, a thread polls `finished()` and draws it against `total` (if
    `show`): the bar moves as work is recorded, whoever does it, with a time left estimated
    from the first progress on."""
    with _tracking(title, total, show) as track:
        with every(poll_seconds, lambda: track(finished()), name="sdq-progress"):
            yield
        track(finished())


def watch(
    title: str,
    total: int,
    finished: Callable[[], int],
    *,
    show: bool = True,
    poll_seconds: float = 0.1,
    stop: Callable[[], int | None] = lambda: None,
    stalled: Callable[[], str | None] = lambda: None,
) -> None:
    """Waits until `finished()` reaches `total`, drawing a progress bar if `show`; each
    poll asks `finished()` once, and draws what it said. A command that waits returns
    within `poll_seconds` of the end, yet asks the database at most a tenth of the time (a
    large run's count takes longer, and is asked less often), and at least once a second
    (one slow answer, the database busy for a moment, is not waited for ten times over).
    When `stop()` says so, it stops as Ctrl-C does. Once nothing has moved for
    STALLED_SECONDS, `stalled()` is asked (once) what to say of it, if anything."""
    began, first, asked_why = time.perf_counter(), None, False
    with _tracking(title, total, show) as track:
        while True:
            if number := stop():  # the signal that stops it (ctrl_c_kept)
                raise KeyboardInterrupt(number)
            asked = time.perf_counter()
            count = finished()
            track(count)
            if count >= total:
                return
            first = count if first is None else first
            if not asked_why and count == first and asked - began > STALLED_SECONDS:
                asked_why = True
                if said := stalled():
                    console.print(f"[yellow]{said}[/yellow]", highlight=False)
            time.sleep(min(max(poll_seconds, 9 * (time.perf_counter() - asked)), 1.0))


# A wait with no progress this long asks why (no worker consumes the run's queue?).
STALLED_SECONDS = 5.0


def status_table(status: dict[str, Any]) -> Table:
    table = Table(title=f"run {status['run_id']}", show_header=True)
    table.add_column("status")
    table.add_column("jobs", justify="right")
    for name, count in status["counts"].items():
        table.add_row(name, str(count))
    table.add_row("[bold]total", f"[bold]{status['total']}")
    return table


def describe_status(status: dict[str, Any]) -> list[str]:
    unit = status["unit"]
    lines = [
        f"{status['succeeded']} of {status['total']} {unit} done, {status['cached']} from cache"
    ]
    if status["finished"] and (unmade := status["counts"].get(PLANNED)):
        retry = f"sdq retry {status['run_id']}"
        lines.append(f"{unmade} job{'s' * (unmade != 1)} not made: the run stopped at a job "
                     f"that did not succeed; `{retry}` goes on from it")  # fmt: skip
    if status["dead"]:
        listing = f"sdq find --run {status['run_id']} --status dead"
        lines.append(f"[red]{status['dead']} failed for good[/red]: `{listing}` lists them")
    for failure in status["failures"]:
        lines.append(
            f"  {failure['jobs']} {failure['status']}: {failure['error']} "
            f"(e.g. `sdq show {failure['example_job']}`)"
        )
    if status["per_second"]:
        lines.append(f"throughput {status['per_second']:.2f} {unit}/s")
    if status["work_seconds"]:
        setup = f"{status['setup_seconds'] or 0:.1f} s loading models, "
        lines.append(f"time spent: {setup}{status['work_seconds']:.1f} s working")
    if status["eta_seconds"]:
        lines.append(f"about {status['eta_seconds']:.0f}s to go")
    return lines


def show_status(status: dict[str, Any]) -> None:
    stdout.print(status_table(status))
    for line in describe_status(status):
        stdout.print(line)


def show_job(job: dict[str, Any]) -> None:
    """Fields one per line, spec included, then the history."""
    fields = {key: value for key, value in job.items() if key not in ("spec", "events")}
    for key, value in {**fields, **job["spec"]}.items():
        # soft_wrap: URIs and hashes stay whole, to be copied.
        stdout.print(f"[bold]{key}[/bold]: {value}", soft_wrap=True, highlight=False)
    stdout.print(rows_table(job["events"], ["at", "status", "worker", "detail"]))


def show_dataset(summary: dict[str, Any]) -> None:
    kept = summary["by_status"].get(SampleStatus.success, 0)
    stdout.print(
        f"[bold]dataset {summary['name']}[/bold]: {summary['samples']} samples, {kept} kept"
    )
    stdout.print(rows_table([summary["by_status"]], list(summary["by_status"]), title="status"))
    if summary["reasons"]:
        reasons = [{"reason": reason, "rows": n} for reason, n in summary["reasons"].items()]
        stdout.print(rows_table(reasons, ["reason", "rows"], title="why samples failed"))
    if summary.get("removed") is not None:
        rules = ", ".join(f"{rule} {bound}" for rule, bound in summary["filter"].items())
        stdout.print(f"made of {summary['made_of']}'s samples ({rules}), no image copied")
        removed = [{"rule": rule, "samples": n} for rule, n in summary["removed"].items()]
        stdout.print(rows_table(removed, ["rule", "samples"], title="left out by"))
    shards = summary["shards"]
    done = sum(shard["done"] for shard in shards)
    stdout.print(f"{done} of {len(shards)} shards done, {summary['bytes']:,} bytes")
    if summary["images_per_second"]:
        stdout.print(f"{summary['images_per_second']:.1f} images/s")
    if shards:
        stdout.print(f"shards: {shards[0]['uri'] or '(not yet written)'} ...", soft_wrap=True)
    if summary.get("page"):
        stdout.print(f"page: {summary['page']}", soft_wrap=True)
    if summary["latents"]:
        bucketed = any("buckets" in row for row in summary["latents"])
        columns = ["model", "resolution", *(["buckets"] if bucketed else []), "shards",
                   "samples", "left out", "samples_per_second", "prefix"]  # fmt: skip
        rows = [
            {**row, "left out": _left_out(row["left_out"]), "buckets": _buckets(row)}
            for row in summary["latents"]
        ]
        stdout.print(rows_table(rows, columns, title="latents"))
    for kind in KINDS.values():
        if (show := kind.producer_hooks().show_dataset) is not None:
            show(summary)


def _buckets(latents: dict[str, Any]) -> str:
    """A bucketed entry's samples per bucket; nothing for squares."""
    return ", ".join(f"{shape}: {count}" for shape, count in latents.get("buckets", {}).items())


def health_table(checks: list[Any]) -> Table:
    table = Table("check", "", "detail", title="sdq health")
    for check in checks:
        table.add_row(check.name, "[green]ok" if check.ok else "[red]DOWN", check.detail)
    return table


def rows_table(
    rows: list[dict[str, Any]],
    columns: list[str],
    *,
    title: str | None = None,
    headers: list[str] | None = None,
) -> Table:
    """The rows' `columns`, under `headers` where given (else the columns' names)."""
    table = Table(*(headers or columns), title=title)
    for row in rows:
        table.add_row(*(_cell(column, row.get(column)) for column in columns))
    return table


def _cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "at" or column.endswith("_at"):
        # ISO timestamps, to the second, in UTC: as text from lookups and SQLite, as
        # datetimes from Postgres through `sdq sql`.
        text = value.isoformat() if isinstance(value, datetime) else str(value)
        return text[:19].replace("T", " ")
    if isinstance(value, dict):
        return ", ".join(f"{key} {count}" for key, count in value.items())
    return str(value)


def _left_out(reasons: dict[str, int]) -> str:
    return ", ".join(f"{count} {reason}" for reason, count in reasons.items()) or "-"
