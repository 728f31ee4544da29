"""A run's jobs done in this process, the embedded way (no broker, no worker): as a worker
would do them, with the bar, Ctrl-C kept (the jobs in hand go back, `sdq resume` goes on),
a full disk said; and carry_out, which does a run here or sends it to the workers."""

import os
import socket
import sys
from collections.abc import Callable
from contextlib import suppress
from typing import NoReturn

from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from sdq.models.cores import cores, torch_threads
from sdq.models.faults import free_space, full_disk
from sdq.models.jobs.kinds import Pool, kind_named
from sdq.models.jobs.lifecycle import Worker, release_jobs
from sdq.models.jobs.outbox import Sent, messages
from sdq.models.tables import FINISHED, Job, JobStatus, Run
from sdq.producer import display, lookups
from sdq.producer.cli.common import (
    DISK_FULL,
    ctrl_c_kept,
    finished_jobs,
    interrupted_by,
    interrupts_held,
    send_run,
    watch_run,
)
from sdq.workers.app import SdqCelery, worker_identity


def work_here(
    app: SdqCelery, run_id: int, *, jobs: int, progress: tuple[int, Callable[[], int]] | None = None
) -> None:
    """Does a run's jobs in this process, message by message, as a worker would: the
    embedded way, with no broker or worker. The bar counts the run's finished jobs, or
    `progress`: a total and what is done of it (a train run's steps)."""
    with app.sessions.begin() as session:
        run = session.get_one(Run, run_id)
        take_back_orphans(session, run_id)
    kind = kind_named(run.kind)
    try:
        if kind.pool is Pool.gpu:
            _say_threads()
        # What the work imports, whole or not at all (GPU work's torch, for its worker's
        # name): a Ctrl-C meanwhile stops it once they are in.
        with interrupts_held():
            app.loader.import_default_modules()  # registers the kinds' tasks with the app
            worker_identity(kind.pool)
        _do_messages(app, run, progress or (jobs, finished_jobs(app, run_id)))
    except KeyboardInterrupt as interrupt:
        stopped_by, code = interrupted_by(interrupt)
        _stop_here(app, run_id, worker_identity(kind.pool), f"stopped by {stopped_by}", code)
    except Exception as error:
        if not (full := full_disk(error)):
            raise
        # soft_wrap: the places' paths stay whole, to be copied.
        display.console.print(
            f"no space left on a disk sdq writes to ({full}); space left: "
            f"{free_space(app.settings)}",
            soft_wrap=True,
        )
        _stop_here(app, run_id, worker_identity(kind.pool), "stopped: disk full", DISK_FULL)


def _do_messages(app: SdqCelery, run: Run, progress: tuple[int, Callable[[], int]]) -> None:
    """The run's messages, each one's jobs done as a worker does them, under a bar counting
    `progress` (a total, and what is done of it)."""
    task = app.tasks[kind_named(run.kind).task_name]
    with display.following(f"run {run.id}", *progress), ctrl_c_kept() as pressed:
        for job_ids in messages(app.sessions, run):
            if number := pressed():  # one that Python dropped
                raise KeyboardInterrupt(number)
            # A retry inside apply() runs at once, in this process; only a crash is left.
            result = task.apply(args=[job_ids], kwargs=run.task_options)
            if result.failed():
                raise result.result


def _say_threads() -> None:
    """What device work here takes of the cores (workers/cores.py sets it)."""
    threads = torch_threads()
    display.console.print(
        f"[dim]working here on {threads} torch thread{'s' * (threads != 1)} of {cores()} "
        "cores (OMP_NUM_THREADS sets it)[/dim]",
        highlight=False,
    )


def take_back_orphans(session: Session, run_id: int) -> None:
    """Puts back the run's jobs that an earlier process on this machine held and did not
    live to put back (killed, or stopped by a full disk that took the database's own
    writes): their lease would free them only later, and no one else works here."""
    host = socket.gethostname()
    holders = session.scalars(
        select(Job.worker_host)
        .where(Job.run_id == run_id, Job.status == JobStatus.running)
        .where(Job.worker_host.startswith(f"{host}:"))
        .distinct()
    )
    for holder in holders.all():
        if not _alive(int(holder.rpartition(":")[2])):
            worker = Worker(host=holder, device="")
            release_jobs(session, run_id, worker=worker, reason="its process here is gone")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _stop_here(app: SdqCelery, run_id: int, worker: Worker, reason: str, code: int) -> NoReturn:
    """The work stopped here (Ctrl-C, a full disk): the jobs in hand go back at once, the
    user learns what is kept and how to go on, and what the process holds is let go before
    it exits (a second Ctrl-C meanwhile waits for that; a third does not)."""
    try:
        _put_back(app, run_id, worker, reason)
    finally:
        with suppress(KeyboardInterrupt), interrupts_held():
            app.let_go()
    sys.exit(code)


def _put_back(app: SdqCelery, run_id: int, worker: Worker, reason: str) -> None:
    """The jobs in hand put back, and what is kept said. Where the database cannot take
    even that (its own disk is full), the next run here takes them back first."""
    try:
        with app.sessions.begin() as session:
            released = release_jobs(session, run_id, worker=worker, reason=reason)
        put_back = f"{len(released)} job{'s' * (len(released) != 1)} in hand put back"
    except DBAPIError as error:
        put_back = f"the jobs in hand could not be put back ({error.orig}) and will be first"
    with app.sessions() as session:
        counts = lookups.run_counts(session, session.get_one(Run, run_id))
    finished = sum(counts[status] for status in FINISHED)
    display.console.print(
        f"stopped: {finished} of {sum(counts.values())} jobs finished, and kept; {put_back}; "
        f"`sdq resume {run_id}` finishes the rest",
        soft_wrap=True,  # the command whole, to be copied
    )


def carry_out(app: SdqCelery, run_id: int, *, jobs: int, wait: bool, as_json: bool) -> Sent | None:
    """Embedded (no broker): does the run here. Otherwise sends it to the workers and, with
    `wait`, watches it finish. Returns what was sent when the run was left to them."""
    with app.sessions() as session:
        hooks = kind_named(session.get_one(Run, run_id).kind).producer_hooks()
    if app.settings.embedded:
        (hooks.resume_here or work_here)(app, run_id, jobs=jobs)
        return None
    sent = send_run(app, run_id)
    if not wait:
        return sent
    (hooks.watch or watch_run)(app, run_id, jobs=jobs, show=not as_json)
    return None
