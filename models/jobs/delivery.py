"""What every worker does with a delivered message, whatever the kind of work:

1. claim the jobs (a duplicate delivery claims nothing and ends here);
2. serve the jobs whose output is already stored, without doing them again;
3. do the rest, renewing the leases while the work runs;
4. record each output as it comes, and a failure against every job still in hand:
   permanent errors (the kind names them) make the jobs dead, others leave them to retry.

A kind supplies only its `Work`; the Celery task that calls `deliver` is a few lines.
"""

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from time import monotonic

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.faults import damaged_weights, device_failure, full_disk
from sdq.models.jobs.claims import claim, extend_leases, held_until
from sdq.models.jobs.lifecycle import (
    Output,
    Worker,
    fail,
    put_back_jobs,
    stored_outputs,
    succeed,
)
from sdq.models.periodic import every
from sdq.models.settings import JobSettings
from sdq.models.store import MissingBucket, StoreUnavailable
from sdq.models.tables import Job

logger = logging.getLogger(__name__)

# How often a delivery records the outputs made so far: what progress bars move by.
RECORD_EVERY_SECONDS = 1.0


class Work(ABC):
    """One kind's work on the jobs of one message."""

    # Errors that another attempt cannot fix: the jobs are dead at once.
    permanent_errors: tuple[type[Exception], ...] = ()
    # Jobs the work left undone on purpose, having given way to work someone waits for
    # (set by `run` before it ends): put back at once, no attempt spent, and sent again.
    left: tuple[int, ...] = ()
    # A dependency that is down for now: retried without using up attempts, for a while.
    # A bucket that is gone is one: an object store that came back empty, not the job's
    # fault (once the outage budget is spent, the jobs fail as for any outage).
    outage_errors: tuple[type[Exception], ...] = (StoreUnavailable, MissingBucket)
    # What the jobs need is not made yet (another kind's jobs make it, each bounded by its
    # own attempts): tried again later, the attempt given back every time.
    waiting_errors: tuple[type[Exception], ...] = ()

    def reuse(self, session: Session, jobs: Sequence[Job]) -> list[Output]:
        """Outputs that already exist for some of the jobs. By default: any job that
        succeeded with the same spec hash, since equal specs make equal outputs."""
        known = stored_outputs(session, [job.spec_hash for job in jobs])
        return [
            Output(job.id, *known[job.spec_hash], work_seconds=None, cached=True)
            for job in jobs
            if job.spec_hash in known
        ]

    @abstractmethod
    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        """Does the jobs, yielding each output once it is stored."""

    def is_permanent(self, error: Exception) -> bool:
        return isinstance(error, self.permanent_errors) or damaged_weights(error) is not None

    def is_outage(self, error: Exception) -> bool:
        # A full disk or a failing device is the machine's, whatever the kind does.
        machine = full_disk(error) or device_failure(error)
        return isinstance(error, self.outage_errors) or machine is not None


@dataclass
class Outcome:
    done: list[int] = field(default_factory=list)
    reused: list[int] = field(default_factory=list)
    # Failed for a reason that may pass: send these again after a back-off.
    retry: list[int] = field(default_factory=list)
    # Held by another worker's lease: look again when it runs out (it may have died).
    held: list[int] = field(default_factory=list)
    held_until: datetime | None = None
    error: str | None = None
    # The failure was an outage (a store away, a full disk), not the jobs' own: retrying at
    # once, as a run in the caller's process would, only meets it again.
    outage: Exception | None = None
    # Jobs of another kind than the task's, named by a stray or forged message: left alone.
    foreign: list[int] = field(default_factory=list)
    # Put back undone, the work having given way (Work.left): to be sent again now.
    put_back: list[int] = field(default_factory=list)


def deliver(
    job_ids: Sequence[int],
    work: Work,
    *,
    kind: str,
    sessions: sessionmaker[Session],
    worker: Worker,
    settings: JobSettings,
    on_claimed: Callable[[list[int]], None] = lambda job_ids: None,
) -> Outcome:
    """A message's jobs, delivered once in effect, whatever fails and wherever; `on_claimed`
    hears which this delivery holds."""
    outcome = Outcome()
    # 1. Claim the message's jobs of this kind: those another worker holds, or that are
    #    done, are left alone.
    jobs = _claim(job_ids, kind, outcome, sessions=sessions, worker=worker, settings=settings)
    if not jobs:
        return outcome
    on_claimed([job.id for job in jobs])
    # 2. Jobs whose outputs are stored already (a twin's, an earlier attempt's) are done.
    todo = _reuse(jobs, work, outcome, sessions=sessions, worker=worker)
    outcome.done = sorted(
        _work_on(todo, work, outcome, sessions=sessions, worker=worker, settings=settings)
    )
    return outcome


def _work_on(
    todo: Sequence[Job],
    work: Work,
    outcome: Outcome,
    *,
    sessions: sessionmaker[Session],
    worker: Worker,
    settings: JobSettings,
) -> set[int]:
    """The jobs left, worked on; returns those done."""
    # 3. Work on them under kept leases, each output recorded as it comes.
    record = Recorder(sessions, worker)
    try:
        with (
            keep_leases(sessions, [job.id for job in todo], worker=worker, settings=settings),
            every(RECORD_EVERY_SECONDS, record.record_waiting, name="sdq-record"),
        ):
            for output in work.run(todo):
                record.add(output)
    except LeaseLost as lost:
        # 4a. The jobs may be another worker's now and the database down: nothing is written.
        outcome.error = f"{type(lost).__name__}: {lost}"
        logger.warning("stopped work on jobs %s: %s", [job.id for job in todo], lost)
    except Exception as error:
        # 4b. What was stored before the failure stays done; the rest fails with the error.
        _fail_the_rest(error, work, todo, record, outcome, sessions=sessions, worker=worker,
                       settings=settings)  # fmt: skip
    else:
        # 4c. Every job done but those the work left (put back): the last outputs recorded.
        outcome.put_back = _finish(work, record, sessions=sessions, worker=worker)
    return record.done


def _finish(
    work: Work, record: "Recorder", *, sessions: sessionmaker[Session], worker: Worker
) -> list[int]:
    """Records the last outputs and puts back what the work left; returns those."""
    with sessions.begin() as session:
        record.flush(session)
        return put_back_jobs(
            session, work.left, worker=worker, reason="put back: gave way to a request"
        )


def _reuse(
    jobs: Sequence[Job],
    work: Work,
    outcome: Outcome,
    *,
    sessions: sessionmaker[Session],
    worker: Worker,
) -> list[Job]:
    """Marks done the jobs whose outputs are stored already; returns the others."""
    with sessions.begin() as session:
        reused = work.reuse(session, jobs)
        succeed(session, reused, worker=worker)
    reused_ids = {output.job_id for output in reused}
    outcome.reused = sorted(reused_ids)
    return [job for job in jobs if job.id not in reused_ids]


def _fail_the_rest(
    error: Exception,
    work: Work,
    todo: Sequence[Job],
    record: "Recorder",
    outcome: Outcome,
    *,
    sessions: sessionmaker[Session],
    worker: Worker,
    settings: JobSettings,
) -> None:
    """The jobs a failure left undone, failed: retried, dead (a permanent error, or out of
    attempts), or waiting out an outage or their inputs without spending an attempt."""
    outcome.error = f"{type(error).__name__}: {error}"
    outcome.outage = error if work.is_outage(error) else None
    with sessions.begin() as session:
        record.flush(session)
        outcome.retry = fail(
            session,
            [job.id for job in todo if job.id not in record.done],
            error=outcome.error,
            permanent=work.is_permanent(error),
            outage=outcome.outage is not None,
            waiting=isinstance(error, work.waiting_errors),
            settings=settings,
            worker=worker,
        )


class Recorder:
    """Records outputs as succeeded every second, on a thread of its own (`every`), while
    the work goes on: progress shows per pipeline call, without a transaction per output,
    and an output handed over is recorded within a second though the work then renders for
    minutes (a call's outputs come together; recorded only as the next one came, all but
    the first waited a whole call more, and a worker killed meanwhile rendered them again).
    Once the work ends the thread is stopped, and the caller records the rest in its own
    transaction (`flush`)."""

    def __init__(self, sessions: sessionmaker[Session], worker: Worker) -> None:
        self.sessions = sessions
        self.worker = worker
        self.done: set[int] = set()
        self._pending: list[Output] = []
        self._lock = threading.Lock()

    def add(self, output: Output) -> None:
        check_lease()  # the work stops here rather than go on with jobs it may not hold
        with self._lock:
            self._pending.append(output)

    def record_waiting(self) -> None:
        """Records the outputs waiting; a database away leaves them for the next time."""
        with self._lock:
            waiting = list(self._pending)
        if not waiting:
            return
        with self.sessions.begin() as session:
            succeed(session, waiting, worker=self.worker)
        with self._lock:  # only added to meanwhile: those recorded are still its first
            del self._pending[: len(waiting)]
            self.done.update(output.job_id for output in waiting)

    def flush(self, session: Session) -> None:
        """Records the outputs waiting, in the caller's transaction."""
        with self._lock:
            waiting, self._pending = self._pending, []
        succeed(session, waiting, worker=self.worker)
        self.done.update(output.job_id for output in waiting)


def _claim(
    job_ids: Sequence[int],
    kind: str,
    outcome: Outcome,
    *,
    sessions: sessionmaker[Session],
    worker: Worker,
    settings: JobSettings,
) -> list[Job]:
    """Claims what nobody holds; notes in `outcome` what a live lease holds, and until when,
    and the jobs of other kinds, which it leaves alone."""
    with sessions.begin() as session:
        kinds = dict(session.execute(select(Job.id, Job.kind).where(Job.id.in_(job_ids))).all())
        outcome.foreign = [job_id for job_id in job_ids if kinds.get(job_id, kind) != kind]
        if outcome.foreign:
            logger.warning(
                "a %s message names jobs of other kinds, left alone: %s",
                kind,
                ", ".join(f"{job_id} ({kinds[job_id]})" for job_id in outcome.foreign),
            )
        jobs = claim(
            session,
            job_ids,
            kind=kind,
            worker=worker,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
        )
        claimed = {job.id for job in jobs}
        held = [i for i in job_ids if i not in claimed and i not in outcome.foreign]
        outcome.held_until = held_until(session, held) if held else None
    outcome.held = held if outcome.held_until else []
    return jobs


class LeaseLost(Exception):
    """The worker could not renew its jobs' leases in time (the database was down): they
    may be another worker's now, so it stops instead of doing them a second time. The
    jobs are left as they are: the sweep sends them again once their lease has run out."""


@dataclass
class Lease:
    """When this delivery last renewed its jobs' leases, on this process's clock."""

    seconds: float
    renewed: float = field(default_factory=monotonic)

    def held(self) -> bool:
        # A margin for the time the claim took before the lease was first counted here.
        return monotonic() - self.renewed < LEASE_MARGIN * self.seconds


LEASE_MARGIN = 0.9
_lease: ContextVar[Lease | None] = ContextVar("sdq_lease", default=None)


def lease_held() -> bool:
    """Whether the delivery this code runs in (if any) still holds its jobs' leases."""
    lease = _lease.get()
    return lease is None or lease.held()


def check_lease() -> None:
    """Raises LeaseLost once the delivery this code runs in has lost its jobs' leases."""
    if not lease_held():
        raise LeaseLost("the jobs' leases were not renewed in time: they may be another's")


@contextmanager
def keep_leases(
    sessions: sessionmaker[Session],
    job_ids: Sequence[int],
    *,
    worker: Worker,
    settings: JobSettings,
) -> Iterator[Lease]:
    """Renews the leases while the work runs, so only a dead worker's jobs ever expire; a
    renewal that fails is tried again (see `every`), and the work learns through
    check_lease() when none has succeeded for a lease's length."""
    lease = Lease(settings.lease_seconds)

    def renew() -> None:
        with sessions.begin() as session:
            extend_leases(session, job_ids, worker=worker, lease_seconds=settings.lease_seconds)
        lease.renewed = monotonic()

    token = _lease.set(lease)
    try:
        # A renewal that fails is tried again within a second, however long the database
        # is gone: one that came back within the lease finds the lease still held.
        with every(settings.lease_seconds / 3, renew, name="sdq-lease", retry_at_most=1.0):
            yield lease
    finally:
        _lease.reset(token)
