"""What every command group shares: the app, one way to answer a lookup, clean errors."""

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import click
from sqlalchemy.orm import Session

from sdq.models import tiny
from sdq.models.db import make_engine
from sdq.models.deployment import recorded_store
from sdq.models.jobs.kinds import WARM, kind_named
from sdq.models.jobs.outbox import EnqueueFailed, Sent, enqueue
from sdq.models.store import StoreError
from sdq.models.tables import FINISHED, Run
from sdq.producer import display, lookups
from sdq.producer.errors import InvalidInput, NotFound
from sdq.producer.health import consumed_queues
from sdq.workers.app import SdqCelery

BAD_INPUT = 2
INTERRUPTED = 128 + signal.SIGINT  # as a shell reports a command stopped by SIGINT
DISK_FULL = 1
DEAD_JOBS = 1  # a run waited for ended with dead jobs
T = TypeVar("T")

pass_app = click.make_pass_decorator(SdqCelery)
json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for programs instead of text."
)


class InputError(click.ClickException):
    """What was given names nothing, or cannot be used: exit status 2, as for a bad option
    (click's UsageError), without the usage text."""

    exit_code = BAD_INPUT


class NothingNamed(InputError):
    """A lookup found nothing of the name it was given (main.py says where it looked)."""


def model_name(_ctx: click.Context, _param: click.Parameter, name: str | None) -> str | None:
    """A name models are registered under (`sdq train --into`, `sdq model push`'s NAME):
    not the built-in model's, which `--model tiny` would go on meaning, nor one a reference
    would read as a checkpoint (NAME@STEP), a run's number or a path."""
    if name == tiny.TINY_NAME:
        raise click.BadParameter(f"{name!r} is sdq's built-in model: name yours otherwise")
    if name is not None and ("@" in name or "/" in name):
        raise click.BadParameter(f"{name!r}: a model name has no '@' or '/'")
    if name is not None and name.isdigit():
        raise click.BadParameter(f"{name!r} would read as run {name} in {name}@STEP: a model "
                                 f"name is more than a number")  # fmt: skip
    return name


@contextmanager
def found() -> Iterator[None]:
    """Turns a lookup's NotFound into a clean command-line error."""
    try:
        yield
    except NotFound as error:
        raise NothingNamed(str(error)) from None


def lookup(
    app: SdqCelery, query: Callable[[Session], T], *, as_json: bool, show: Callable[[T], None]
) -> T:
    """Answers a read-only question: JSON for programs, `show` for people."""
    with app.sessions() as session, found():
        answer = query(session)
    if as_json:
        display.print_json(answer)
    else:
        show(answer)
    return answer


def table(columns: list[str]) -> Callable[[list[dict[str, Any]]], None]:
    """A `show` for `lookup` that prints rows as a table of these columns."""
    return lambda rows: display.stdout.print(display.rows_table(rows, columns))


def ensure_schema(app: SdqCelery, *, make: bool = False) -> None:
    """Embedded SQLite is made by the commands that make runs (`make`) and migrated on
    first use by any; a shared database is migrated on purpose."""
    from sdq.migrations import ready

    engine = make_engine(app.settings.database_url) if make else app.engine
    try:
        current = ready(engine)
    finally:
        if make:
            engine.dispose()
    if not current:
        raise click.ClickException("the database schema is not current: run `sdq db upgrade`")


def ready_to_submit(app: SdqCelery) -> None:
    """What every command that makes a run checks before it writes anything: the schema,
    and a store the workers can write to (without one, every job would fail), the
    deployment's."""
    ensure_schema(app, make=True)
    # Before the store's own check: a mistyped bucket is another store than the
    # deployment's, not one to make.
    require_deployment_store(app)
    ensure_store(app)


def ready_to_work(app: SdqCelery, what: str) -> None:
    """What a worker checks as it starts, before it takes any message: a broker, a
    database it can reach (a wrong URL would take messages and fail them for ever), and
    the deployment's store. Not the schema's revision: in a rolling upgrade, workers of
    the last release run on beside the newest schema."""
    require_broker(app, what)
    require_deployment_store(app)


def require_deployment_store(app: SdqCelery) -> None:
    """With a broker, this process's store is the one `sdq db upgrade` recorded: outputs
    written elsewhere would be recorded where other machines cannot read them (a worker
    started without SDQ_STORE_URL writes to its own folder), and served from cache ever
    after. Embedded, the store is the home's own."""
    if app.settings.embedded:
        return
    with app.sessions() as session:
        recorded = recorded_store(session)
    if recorded is not None and recorded != app.store.uri(""):
        raise click.ClickException(other_store(recorded, app))


def other_store(recorded: str, app: SdqCelery) -> str:
    return (
        f"this deployment's outputs are in {recorded} (as `sdq db upgrade` recorded), and "
        f"this process's store is {app.store.uri('')} (SDQ_STORE_URL, or without it "
        "SDQ_HOME's folder): set SDQ_STORE_URL to the deployment's; `sdq db upgrade "
        "--move-store` records this one as the deployment's instead (it copies no file)"
    )


def ensure_store(app: SdqCelery) -> None:
    try:
        app.store.check()
    except StoreError as error:
        raise InputError(f"object store {app.settings.store_url}: {error}") from None


def require_broker(app: SdqCelery, what: str) -> None:
    if app.settings.embedded:
        raise click.UsageError(
            f"{what} needs a broker: set SDQ_BROKER_URL (e.g. redis://host:6379/0)"
        )


def send_run(app: SdqCelery, run_id: int, *, total: int | None = None, show: bool = False) -> Sent:
    """Sends the run's unfinished jobs that no live worker holds (the outbox's send), with a
    bar against `total` (or a count) when `show`."""
    try:
        with (
            app.sender() as send,
            display.counting("sending", total=total, show=show) as sent,
            ctrl_c_kept(),  # SIGTERM too
        ):
            return enqueue(app.sessions, send, run_id, on_sent=sent)
    except EnqueueFailed as error:
        raise click.ClickException(str(error)) from None
    except KeyboardInterrupt as interrupt:
        # The jobs are committed already: what was not sent stays queued, for the relay.
        display.console.print(
            f"stopped sending: run {run_id}'s jobs not sent yet stay queued; beat's relay "
            f"sends them once their queue is idle, `sdq requeue {run_id}` at once",
            soft_wrap=True,
        )
        sys.exit(interrupted_by(interrupt)[1])


def report_submission(fields: dict[str, Any], line: str, *, as_json: bool) -> None:
    """What a submitting command prints: the fields as JSON, or the run id alone on stdout
    (for scripts) and a sentence for people on stderr."""
    if as_json:
        display.print_json(fields)
        return
    click.echo(fields["run_id"])
    display.console.print(line)


def finished_jobs(app: SdqCelery, run_id: int) -> Callable[[], int]:
    """How many of the run's jobs have finished, asked anew at each call."""

    def finished() -> int:
        with app.sessions() as session:
            counts = lookups.status_counts(session, run_id)
        return sum(counts[status] for status in FINISHED)

    return finished


def watch_run(app: SdqCelery, run_id: int, *, jobs: int, show: bool) -> None:
    """Waits for the run's jobs to finish, with a progress bar when `show`."""
    watch_progress(run_id, f"run {run_id}", jobs, finished_jobs(app, run_id), show=show,
                   stalled=no_worker_for(app, run_id))  # fmt: skip


def watch_progress(
    run_id: int,
    title: str,
    total: int,
    done: Callable[[], int],
    *,
    show: bool,
    stalled: Callable[[], str | None] = lambda: None,
) -> None:
    """Waits until `done()` reaches `total` (a run's jobs, a train run's steps); Ctrl-C
    stops the watching, not the run. A wait that does not move says what `stalled` says."""
    with watching(run_id) as pressed:
        display.watch(title, total, done, show=show, stop=pressed, stalled=stalled)


def no_worker_for(app: SdqCelery, run_id: int) -> Callable[[], str | None]:
    """What to say of a run that waits, where no live worker consumes its kind's queue (or
    a warm one of it)."""

    def said() -> str | None:
        with app.sessions() as session:
            kind = kind_named(session.get_one(Run, run_id).kind)
        if any(name == kind.queue or name.startswith(f"{kind.queue}{WARM}")
               for name in consumed_queues(app)):  # fmt: skip
            return None
        return (
            f"no worker consumes the {kind.queue} queue now: the run waits for one "
            f"(`sdq worker {kind.pool}`; `sdq health` lists the workers)"
        )

    return said


@contextmanager
def watching(run_id: int) -> Iterator[Callable[[], int | None]]:
    """Ctrl-C while the workers do a run stops the watching, not the run: say so, and how
    to watch again. The body is given whether Ctrl-C was pressed, to stop on a press that
    Python dropped (see `ctrl_c_kept`): with no worker running, the watch would never end."""
    try:
        with ctrl_c_kept() as pressed:
            yield pressed
    except KeyboardInterrupt as interrupt:
        display.console.print(
            f"stopped watching: run {run_id} goes on on the workers; "
            f"`sdq resume {run_id} --wait` watches it again",
            soft_wrap=True,
        )
        sys.exit(interrupted_by(interrupt)[1])


@contextmanager
def ctrl_c_kept() -> Iterator[Callable[[], int | None]]:
    """Ctrl-C raises KeyboardInterrupt as always, and is remembered; so does SIGTERM (a
    `timeout`, a service manager, a `kill`), which would otherwise end the process where
    it stands, its jobs held until their lease ran out. Yields what says which signal came,
    if one did. Python drops one that lands while a callback of the garbage collector runs
    ("Exception ignored in ..."): it is sent again, to land in the work itself, so that the
    job in hand stops and goes back rather than running to its end. A signal the command
    was started deaf to (SIGINT in the background, by a script) stays ignored."""
    heard = _heard()
    received: list[int] = []
    left = threading.Event()

    def interrupted(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt(signum)

    def dropped(unraisable: Any) -> None:
        if not issubclass(unraisable.exc_type, KeyboardInterrupt) or not received:
            return previous_hook(unraisable)
        # Not from here: a signal sent now would be handled inside this hook, and dropped.
        threading.Timer(0.05, _send_again, args=(left, received[-1])).start()

    previous = {number: signal.signal(number, interrupted) for number in heard}
    previous_hook, sys.unraisablehook = sys.unraisablehook, dropped
    try:
        yield lambda: received[-1] if received else None
    finally:
        left.set()
        sys.unraisablehook = previous_hook
        _handle_with(previous)


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait for the block's end, and then stop the command as they
    would have (KeyboardInterrupt): for what must not be cut short. An import of torch cut
    short leaves a process that cannot import it again (its stop then failed on that) and
    may crash as it exits. A second one acts at once: a block that hangs (a GPU driver
    that does not answer) can still be stopped."""
    received: list[int] = []
    previous: dict[int, Any] = {}

    def held(signum: int, _: Any) -> None:
        received.append(signum)
        _handle_with(previous)

    for number in _heard():
        previous[number] = signal.signal(number, held)
    try:
        yield
    finally:
        _handle_with(previous)
    if received:
        raise KeyboardInterrupt(received[0])


def _handle_with(handlers: dict[int, Any]) -> None:
    """Each of these signals handled by the handler given for it."""
    for number, handler in handlers.items():
        signal.signal(number, handler)


def _heard() -> list[int]:
    """SIGINT and SIGTERM, less one the command was started deaf to (SIGINT in the
    background, by a script): that one stays ignored."""
    return [number for number in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(number) is not signal.SIG_IGN]  # fmt: skip


def interrupted_by(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the work (the signal ctrl_c_kept raised it for, else Ctrl-C), in words,
    and the exit status a shell gives a command stopped by that signal: 128 + its number."""
    number = next(iter(interrupt.args), None)
    if not isinstance(number, int):
        number = signal.SIGINT
    if number == signal.SIGINT:
        return "Ctrl-C", INTERRUPTED
    return signal.Signals(number).name, 128 + number


def _send_again(left: threading.Event, number: int) -> None:
    if not left.is_set():
        os.kill(os.getpid(), number)


def exit_if_dead(app: SdqCelery, run_id: int) -> None:
    """A run that ended with dead jobs fails the command that did it or waited for it
    (a script sees it), with the first dead job's reason."""
    with app.sessions() as session:
        dead = lookups.first_dead(session, run_id)
    if dead is None:
        return
    job_id, error, count = dead
    click.echo(f"run {run_id}: {count} job{'s' * (count != 1)} dead; the first, job {job_id}: "
               f"{error} (`sdq show {job_id}`)", err=True)  # fmt: skip
    sys.exit(DEAD_JOBS)


@contextmanager
def extra_needed(command: str, extra: str) -> Iterator[None]:
    """Around the imports of an extra a command needs: where one is missing, a line saying
    which extra to install instead of a traceback."""
    try:
        yield
    except ModuleNotFoundError as error:
        package = (error.name or "a module").partition(".")[0]
        raise click.ClickException(
            f"{command} needs the {extra} extra ({package} is missing): pip install 'sdq[{extra}]'"
        ) from None


def exit_bad_input(problems: InvalidInput) -> NoReturn:
    for error in problems.errors:
        click.echo(str(error), err=True)
    click.echo(f"{len(problems.errors)} problem(s); nothing was submitted.", err=True)
    sys.exit(BAD_INPUT)
