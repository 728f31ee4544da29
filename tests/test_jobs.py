"""The generic job layer with a trivial work function, on SQLite and on Postgres.

No torch and no broker: the work writes a spec's text to a local store, and the outbox
sends into a list. What is checked is what every kind relies on.
"""

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, func, make_url, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from sdq.migrations import upgrade
from sdq.models.db import make_engine, session_factory
from sdq.models.jobs import lifecycle, outbox
from sdq.models.jobs.claims import cancel_jobs, claim, extend_leases, held_until
from sdq.models.jobs.delivery import Outcome, Work, deliver
from sdq.models.jobs.kinds import GENERATE, TRAIN, Kind
from sdq.models.jobs.lifecycle import Output, Worker, as_utc, fail, succeed, utcnow
from sdq.models.jobs.maintenance import EXPIRED, finish_runs, relay, sweep_leases
from sdq.models.jobs.outbox import EnqueueFailed, enqueue
from sdq.models.rollups import roll_up
from sdq.models.settings import JobSettings
from sdq.models.specs import canonical_sha256
from sdq.models.store import LocalStore
from sdq.models.tables import HourlyRollup, Job, JobEvent, JobStatus, Run
from sdq.producer.lookups import run_status
from tests.services import OutageProxy, scratch_database

WORKER = Worker("echo-host:1", "cpu")
SETTINGS = JobSettings(lease_seconds=60, max_attempts=2)


class EchoWork(Work):
    """Stores each job's text; a spec can ask to fail, for a permanent or passing reason
    (one that uses up an attempt: not an outage of the store)."""

    permanent_errors = (LookupError,)

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.ran: list[int] = []
        self.go_on = threading.Event()  # what a job whose spec says "held" waits for
        self.started = threading.Event()  # its jobs claimed, the work begun

    def run(self, jobs: Sequence[Job]) -> Iterator[Output]:
        self.started.set()
        for job in jobs:
            failure = job.spec.get("fail")
            if failure == "permanent":
                raise LookupError(f"no such thing as {job.spec['text']!r}")
            if failure == "passing":
                raise TimeoutError("the work took too long this time")
            time.sleep(job.spec.get("seconds", 0))
            if job.spec.get("held"):
                self.go_on.wait(60)
            self.ran.append(job.id)
            data = job.spec["text"].encode()
            uri = self.store.put_bytes(f"echo/{job.spec_hash}", data, content_type="text/plain")
            yield Output(job.id, uri, canonical_sha256(job.spec["text"]), work_seconds=0.0)


@pytest.fixture(params=["sqlite", "postgres"])
def sessions(request, tmp_path: Path) -> sessionmaker[Session]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'jobs.db'}"
        upgrade(make_engine(url))
    else:
        url = request.getfixturevalue("migrated_postgres")
    return session_factory(make_engine(url))


@pytest.fixture
def work(tmp_path: Path) -> EchoWork:
    return EchoWork(LocalStore(tmp_path / "store"))


def new_run(
    sessions,
    *specs: dict[str, Any],
    jobs_per_message: int = 2,
    status: JobStatus = JobStatus.pending,
    kind: Kind = GENERATE,
) -> list[int]:
    with sessions.begin() as session:
        run = Run(kind=kind.name, source="test", options={}, job_count=len(specs))
        run.jobs_per_message = jobs_per_message
        session.add(run)
        session.flush()
        jobs = [
            Job(
                run_id=run.id,
                kind=kind.name,
                spec=spec,
                spec_hash=canonical_sha256(spec),
                status=status,
            )
            for spec in specs
        ]
        session.add_all(jobs)
        session.flush()
        return [job.id for job in jobs]


def statuses(sessions, job_ids: list[int]) -> list[tuple[JobStatus, int]]:
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids)).order_by(Job.id))
        return [(job.status, job.attempts) for job in jobs]


def run_of(sessions, job_id: int) -> Run:
    with sessions() as session:
        return session.get(Run, session.get(Job, job_id).run_id)


def test_work_is_done_once_and_equal_specs_are_reused(sessions, work: EchoWork) -> None:
    first = new_run(sessions, {"text": "a"}, {"text": "b"})
    outcome = deliver(
        first, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (outcome.done, outcome.reused, outcome.retry) == (first, [], [])
    assert work.store.get_bytes(f"echo/{canonical_sha256({'text': 'b'})}") == b"b"
    # The same delivery again (a duplicated message) claims nothing and does nothing.
    again = deliver(
        first, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (again.done, again.reused, work.ran) == ([], [], first)
    # Another run asking for an output that exists is served, not redone.
    second = new_run(sessions, {"text": "a"}, {"text": "c"})
    outcome = deliver(
        second, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (outcome.reused, outcome.done) == ([second[0]], [second[1]])
    assert statuses(sessions, second) == [(JobStatus.succeeded, 1)] * 2
    assert run_of(sessions, second[0]).finished_at is not None
    with sessions() as session:
        history = session.scalars(
            select(JobEvent.status).where(JobEvent.job_id == second[0]).order_by(JobEvent.id)
        ).all()
    assert history == [JobStatus.running, JobStatus.succeeded]


def test_passing_failures_retry_up_to_the_cap_and_permanent_ones_end_at_once(
    sessions, work: EchoWork
) -> None:
    [passing] = new_run(sessions, {"text": "later", "fail": "passing"})
    outcome = deliver(
        [passing], work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert outcome.retry == [passing] and "TimeoutError" in outcome.error
    assert statuses(sessions, [passing]) == [(JobStatus.failed, 1)]
    outcome = deliver(
        [passing], work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert outcome.retry == [] and statuses(sessions, [passing]) == [(JobStatus.dead, 2)]

    [permanent] = new_run(sessions, {"text": "nothing", "fail": "permanent"})
    outcome = deliver(
        [permanent], work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert outcome.retry == [] and statuses(sessions, [permanent]) == [(JobStatus.dead, 1)]
    with sessions() as session:
        assert "no such thing as 'nothing'" in session.get(Job, permanent).error
    assert run_of(sessions, permanent).finished_at is not None


def test_what_was_stored_before_a_failure_stays_done(sessions, work: EchoWork) -> None:
    job_ids = new_run(sessions, {"text": "kept"}, {"text": "lost", "fail": "passing"})
    outcome = deliver(
        job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (outcome.done, outcome.retry) == ([job_ids[0]], [job_ids[1]])
    assert statuses(sessions, job_ids) == [(JobStatus.succeeded, 1), (JobStatus.failed, 1)]


def test_outputs_are_recorded_while_their_message_is_still_at_work(
    sessions, work: EchoWork
) -> None:
    """What progress bars and `sdq status` move by: outputs recorded as they come (a
    second at most apart), not all at the end of the message; with the first ones, the
    status has a time left."""
    job_ids = new_run(
        sessions, *({"text": f"slow {n}", "seconds": 0.5} for n in range(5)), jobs_per_message=5
    )
    run_id = run_of(sessions, job_ids[0]).id
    seen: list[tuple[int, float | None]] = []
    delivered = threading.Event()

    def watch() -> None:
        while not delivered.wait(0.1):
            with sessions() as session:
                status = run_status(session, run_id, with_jobs=False)
            seen.append((status["succeeded"], status["eta_seconds"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        deliver(
            job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
        )
    finally:
        delivered.set()
        watcher.join()
    midway = [eta for done, eta in seen if 0 < done < 5]
    assert midway and all(eta and eta > 0 for eta in midway), seen
    assert statuses(sessions, job_ids) == [(JobStatus.succeeded, 1)] * 5


def test_outputs_that_came_together_are_recorded_while_the_work_goes_on_for_long(
    sessions, work: EchoWork
) -> None:
    """A pipeline call's outputs come at once, then the next call renders for minutes:
    those stored are recorded meanwhile (a worker killed in that call would otherwise render
    them again), not only once another output comes."""
    together = [{"text": f"came together {n}"} for n in range(2)]
    job_ids = new_run(sessions, *together, {"text": "held", "held": True}, jobs_per_message=3)
    delivered: list[Outcome] = []
    delivery = threading.Thread(target=lambda: delivered.append(deliver(
        job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )))  # fmt: skip
    delivery.start()
    try:
        # Told to go on only once the first two are recorded: while c is held, nothing else
        # comes that could record them with it.
        for _ in range(300):
            if statuses(sessions, job_ids[:2]) == [(JobStatus.succeeded, 1)] * 2:
                break
            time.sleep(0.1)
        recorded_while_held = statuses(sessions, job_ids)
    finally:
        work.go_on.set()
        delivery.join()
    assert recorded_while_held == [(JobStatus.succeeded, 1)] * 2 + [(JobStatus.running, 1)]
    assert delivered[0].done == job_ids
    assert statuses(sessions, job_ids) == [(JobStatus.succeeded, 1)] * 3


def test_a_job_another_worker_holds_is_left_to_it_until_its_lease_ends(
    sessions, work: EchoWork
) -> None:
    job_ids = new_run(sessions, {"text": "mine"}, {"text": "theirs"})
    with sessions.begin() as session:
        claim(session, job_ids[1:], kind=GENERATE.name, worker=Worker("other:2", "cpu"),
              lease_seconds=60, max_attempts=2)  # fmt: skip
    outcome = deliver(
        job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert outcome.done == job_ids[:1] and outcome.held == job_ids[1:]
    assert outcome.held_until is not None
    # Its worker gone, the lease runs out: the next delivery takes it over, and its history
    # says why it runs a second time.
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id == job_ids[1])
                        .values(lease_expires_at=utcnow() - timedelta(seconds=1)))  # fmt: skip
    taken = deliver(
        job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert taken.done == job_ids[1:]
    with sessions() as session:
        history = session.execute(
            select(JobEvent.status, JobEvent.worker_host, JobEvent.detail)
            .where(JobEvent.job_id == job_ids[1], JobEvent.status == JobStatus.running)
            .order_by(JobEvent.id)
        ).all()
    assert [tuple(event) for event in history] == [
        (JobStatus.running, "other:2", None),
        (JobStatus.running, WORKER.host, "taken over: the lease of other:2 ran out"),
    ]


def test_a_success_is_recorded_only_for_the_jobs_the_worker_holds(sessions) -> None:
    """Outputs handed in for jobs this worker does not hold (still queued, dead, or held by
    another worker since its lease lapsed) change nothing and add nothing to their history."""
    queued, dead, taken, mine = new_run(
        sessions, *({"text": name} for name in ("queued", "dead", "taken", "mine")),
        status=JobStatus.queued,
    )  # fmt: skip
    with sessions.begin() as session:
        claim(session, [taken], kind=GENERATE.name, worker=Worker("other:2", "cpu"),
              lease_seconds=60, max_attempts=2)  # fmt: skip
        claim(session, [mine], kind=GENERATE.name, worker=WORKER, lease_seconds=60,
              max_attempts=2)  # fmt: skip
        session.execute(update(Job).where(Job.id == dead).values(status=JobStatus.dead))
    with sessions.begin() as session:
        outputs = [Output(job_id, f"mem://{job_id}", "0" * 64, work_seconds=1.0)
                   for job_id in (queued, dead, taken, mine)]  # fmt: skip
        succeed(session, outputs, worker=WORKER)
    ours = (queued, dead, taken, mine)
    with sessions() as session:
        statuses = dict(session.execute(select(Job.id, Job.status).where(Job.id.in_(ours))).all())
        succeeded = session.scalars(
            select(JobEvent.job_id).where(
                JobEvent.job_id.in_(ours), JobEvent.status == JobStatus.succeeded
            )
        ).all()
    assert [statuses[job_id] for job_id in ours] == [
        JobStatus.queued, JobStatus.dead, JobStatus.running, JobStatus.succeeded
    ]  # fmt: skip
    assert succeeded == [mine]


def test_a_run_whose_last_jobs_end_at_once_on_two_workers_is_finished(
    migrated_postgres,
) -> None:
    """Two workers record a run's last two jobs in transactions that overlap, each seeing
    the other's job still running: the run is finished all the same, as the second commits,
    not left open for the beat's sweep."""
    sessions = session_factory(make_engine(migrated_postgres))
    first, second = new_run(sessions, {"text": "a"}, {"text": "b"}, status=JobStatus.queued)
    other = Worker("other-host:2", "cpu")
    with sessions.begin() as session:
        for job_id, worker in ((first, WORKER), (second, other)):
            claim(session, [job_id], kind=GENERATE.name, worker=worker, lease_seconds=60,
                  max_attempts=2)  # fmt: skip

    def record(session: Session, job_id: int, worker: Worker) -> None:
        succeed(session, [Output(job_id, "mem://x", "0" * 64, work_seconds=1.0)], worker=worker)

    def record_alone(job_id: int, worker: Worker) -> None:
        with sessions.begin() as session:
            record(session, job_id, worker)

    with sessions.begin() as session:
        record(session, first, WORKER)
        # The other worker records its job before this transaction commits.
        meanwhile = threading.Thread(target=record_alone, args=(second, other))
        meanwhile.start()
        meanwhile.join(timeout=1)
    meanwhile.join(timeout=30)
    with sessions() as session:
        finished = session.scalar(
            select(Run.finished_at).join(Job, Job.run_id == Run.id).where(Job.id == first)
        )
    assert finished is not None


def test_a_message_of_another_kind_leaves_its_jobs_alone(sessions, work: EchoWork) -> None:
    job_ids = new_run(sessions, {"text": "a generation"}, status=JobStatus.queued)
    outcome = deliver(
        job_ids, work, kind=TRAIN.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (outcome.foreign, outcome.done, outcome.retry, outcome.held) == (job_ids, [], [], [])
    with sessions() as session:
        job = session.get(Job, job_ids[0])
        assert (job.status, job.attempts) == (JobStatus.queued, 0)
        assert not session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()


def test_the_outbox_sends_after_commit_and_resends_what_the_broker_never_took(
    sessions, monkeypatch
) -> None:
    # As a submit writes them: committed for delivery, messages to follow.
    job_ids = new_run(
        sessions, *({"text": str(n)} for n in range(5)), jobs_per_message=2,
        status=JobStatus.queued,
    )  # fmt: skip
    run_id = run_of(sessions, job_ids[0]).id
    monkeypatch.setattr(outbox, "PAGE", 4)  # two messages per page
    sent: list[tuple[str, list[int]]] = []

    def broker_down_after_one_page(
        kind: Kind, messages: list[list[int]], options: dict[str, Any]
    ) -> None:
        if sent:
            raise ConnectionError("broker went away")
        sent.extend((kind.task_name, ids) for ids in messages)

    with pytest.raises(EnqueueFailed, match="took 2 messages"):
        enqueue(sessions, broker_down_after_one_page, run_id)
    assert sent == [("sdq.generate", job_ids[:2]), ("sdq.generate", job_ids[2:4])]
    # What the broker may not have taken goes back to waiting for a send.
    assert [status for status, _ in statuses(sessions, job_ids)] == [JobStatus.queued] * 4 + [
        JobStatus.pending
    ]

    def broker(kind: Kind, messages: list[list[int]], options: dict[str, Any]) -> None:
        sent.extend((kind.task_name, ids) for ids in messages)

    # Sending again sends every job no worker holds, queued ones included: the broker may
    # have lost them, and a job sent twice is claimed once.
    sent.clear()
    pages: list[int] = []
    assert enqueue(sessions, broker, run_id, on_sent=pages.append).jobs == 5
    assert pages == [4, 1]  # what a progress bar is told, page by page
    assert [ids for _, ids in sent] == [job_ids[:2], job_ids[2:4], job_ids[4:]]
    assert {status for status, _ in statuses(sessions, job_ids)} == {JobStatus.queued}
    # The history says what happened: jobs the broker took at once need no row; the
    # others were sent back to wait, with the reason, then sent.
    with sessions() as session:
        events = session.execute(
            select(JobEvent.job_id, JobEvent.status, JobEvent.detail)
            .where(JobEvent.job_id.in_(job_ids))
            .order_by(JobEvent.id)
        ).all()
    assert [event for event in events if event[0] == job_ids[0]] == []
    assert [(status, detail) for job_id, status, detail in events if job_id == job_ids[4]] == [
        (JobStatus.pending, "not sent: broker went away"),
        (JobStatus.queued, None),
    ]
    # Cancelled jobs are finished: nothing is left to send, and the run is closed.
    with sessions.begin() as session:
        assert cancel_jobs(session, run_id) == job_ids
    assert enqueue(sessions, broker, run_id).jobs == 0
    assert run_of(sessions, job_ids[0]).finished_at is not None


# Counted in the transaction, not yet in the statistics views: the jobs rows read by a
# sequential scan, and those fetched from the table or through any of its indexes.
ROWS_READ = """
    SELECT pg_stat_get_xact_tuples_returned('jobs'::regclass)
        + sum(pg_stat_get_xact_tuples_fetched(relation))::bigint FROM (
        SELECT 'jobs'::regclass::oid
        UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid = 'jobs'::regclass
    ) AS relations (relation)
"""


def test_a_run_is_sent_a_page_at_a_time_each_read_from_where_the_last_ended(monkeypatch) -> None:
    """Right after it is written a run's rows have no statistics (a database of its own
    here, never analyzed), and each page of its send used to read every job of the run and
    sort those still to come: a cost that grows with the square of the run's size. Each
    page now reads its own jobs, whatever the planner guesses (at this size, with the index
    and no more, it still chose to sort). A later re-send of the run, mostly done by then,
    reads the index alone."""
    jobs, page = 20_000, 2_000
    monkeypatch.setattr(outbox, "PAGE", page)
    with scratch_database("sdq_pages") as url:
        engine = make_engine(url)
        upgrade(engine)
        sessions = session_factory(engine)
        # The table holds other runs' jobs, as any does; each run written as a submit does.
        written_run(sessions, [{"text": f"earlier {n}"} for n in range(5_000)])
        run, job_ids = written_run(sessions, [{"text": f"paged {n}"} for n in range(jobs)])
        sent: list[int] = []

        def broker(kind: Kind, messages: list[list[int]], options: dict[str, Any]) -> None:
            sent.extend(job_id for ids in messages for job_id in ids)

        try:
            read = rows_read_by_page(engine, lambda: outbox.enqueue(sessions, broker, run.id))
            assert sent == job_ids
            # Later, all but a hundred jobs done and the table vacuumed: a re-send of the
            # run reads the index alone, not a row of each of its jobs.
            with sessions.begin() as session:
                done = (Job.run_id == run.id) & (Job.id > job_ids[99])
                session.execute(update(Job).where(done).values(status=JobStatus.succeeded))
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as vacuum:
                vacuum.execute(text("VACUUM ANALYZE jobs"))
            sent.clear()
            read_again = rows_read_by_page(engine, lambda: outbox.enqueue(sessions, broker, run.id))
        finally:
            engine.dispose()
    assert len(read) == 11  # ten full pages, and the empty one that ends the send
    assert max(read) <= 2 * page and sum(read) <= 2 * jobs
    assert sent == job_ids[:100] and sum(read_again) <= 2 * 100


def written_run(sessions, specs: list[dict[str, Any]]) -> tuple[Run, list[int]]:
    with sessions.begin() as session:
        run = outbox.open_run(session, GENERATE, source="test", options={}, jobs_per_message=50)
        hashes = [canonical_sha256(spec) for spec in specs]
        return run, outbox.write_jobs(session, run.id, GENERATE, specs, hashes, utcnow()).ids


def rows_read_by_page(engine: Engine, send: Callable[[], object]) -> list[int]:
    """The jobs rows each page's query read as `send` ran, counted in its transaction."""
    read: list[int] = []

    def rows_read(connection) -> int:
        with connection.connection.dbapi_connection.cursor() as counting:
            counting.execute(ROWS_READ)
            return counting.fetchone()[0]

    def page_query(statement: str) -> bool:
        return statement.startswith("SELECT jobs.id") and "LIMIT" in statement

    def before(connection, cursor, statement: str, *rest) -> None:
        if page_query(statement):
            read.append(-rows_read(connection))

    def after(connection, cursor, statement: str, *rest) -> None:
        if page_query(statement):
            read[-1] += rows_read(connection)

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    try:
        send()
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    return read


def test_maintenance_expires_dead_leases_and_sends_again_only_what_is_lost(sessions) -> None:
    hour_ago = utcnow() - timedelta(hours=1)
    # A worker died holding two jobs, one with an attempt left; two more wait in the queue.
    dropped, exhausted, waiting, fresh = new_run(
        sessions, *({"text": str(n)} for n in range(4)), status=JobStatus.queued
    )
    with sessions.begin() as session:
        claim(
            session,
            [dropped, exhausted],
            kind=GENERATE.name,
            worker=WORKER,
            lease_seconds=60,
            max_attempts=2,
        )
        session.execute(update(Job).where(Job.id == exhausted).values(attempts=2))
        session.execute(
            update(Job).where(Job.id.in_([dropped, exhausted])).values(lease_expires_at=hour_ago)
        )
        session.execute(update(Job).where(Job.id == waiting).values(enqueued_at=hour_ago))
        session.execute(update(Job).where(Job.id == fresh).values(enqueued_at=utcnow()))
    mine = {dropped, exhausted, waiting, fresh}

    sent_back, dead = sweep_leases(sessions, SETTINGS)  # other tests' jobs may count too
    assert sent_back >= 1 and dead >= 1
    assert statuses(sessions, [dropped, exhausted]) == [(JobStatus.pending, 1), (JobStatus.dead, 2)]
    sent: list[int] = []

    def broker(kind: Kind, messages: list[list[int]], options: dict[str, Any]) -> None:
        sent.extend(job_id for ids in messages for job_id in ids if job_id in mine)

    # The queue still holds messages: only the job that no message carries is sent.
    relay(sessions, broker, relay_after=timedelta(minutes=1), idle_queues=())
    assert sent == [dropped]
    # The queue is empty: the job left unclaimed past the relay time is taken for lost;
    # the one just sent, and the one queued a moment ago, are not.
    sent.clear()
    relay(sessions, broker, relay_after=timedelta(minutes=1), idle_queues=(GENERATE.queue,))
    assert sent == [waiting]
    sent.clear()
    relay(sessions, broker, relay_after=timedelta(minutes=1), idle_queues=(GENERATE.queue,))
    assert sent == []
    with sessions() as session:
        details = session.scalars(
            select(JobEvent.detail).where(JobEvent.job_id == dropped).order_by(JobEvent.id)
        ).all()
    assert details[-2:] == [EXPIRED, "sent again by the relay"]

    # Every job settled by hand: the finisher closes the run.
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id.in_(mine)).values(status=JobStatus.cancelled))
    assert run_of(sessions, dropped).finished_at is None
    assert finish_runs(sessions) >= 1
    assert run_of(sessions, dropped).finished_at is not None


def test_cancel_takes_what_no_worker_holds_and_leaves_live_work_to_finish(sessions) -> None:
    """A job left running by a killed process (an embedded run's, which no beat takes
    back) is cancelled once its lease has run out; one a live worker holds finishes; a
    queued one is cancelled."""
    killed, live, waiting = new_run(sessions, *({"text": str(n)} for n in range(3)),
                                    status=JobStatus.queued)  # fmt: skip
    with sessions.begin() as session:
        claim(session, [killed, live], kind=GENERATE.name, worker=WORKER, lease_seconds=60,
              max_attempts=2)  # fmt: skip
        lapsed = utcnow() - timedelta(seconds=1)
        session.execute(update(Job).where(Job.id == killed).values(lease_expires_at=lapsed))
        run_id = session.get_one(Job, killed).run_id
    with sessions.begin() as session:
        assert cancel_jobs(session, run_id) == [killed, waiting]
    assert statuses(sessions, [killed, live, waiting]) == [
        (JobStatus.cancelled, 1),
        (JobStatus.running, 1),
        (JobStatus.cancelled, 0),
    ]
    assert run_of(sessions, live).finished_at is None  # its live job is still to finish


def test_a_job_whose_twin_is_being_made_waits_and_is_served_its_output(
    sessions, work: EchoWork
) -> None:
    making, waiting = new_run(sessions, {"text": "twin"}, {"text": "twin"})
    other = Worker("other:2", "cpu")
    with sessions.begin() as session:
        claim(session, [making], kind=GENERATE.name, worker=other, lease_seconds=60,
              max_attempts=2)  # fmt: skip
    outcome = deliver(
        [waiting], work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (outcome.held, outcome.done, work.ran) == ([waiting], [], [])
    assert outcome.held_until - utcnow() < timedelta(seconds=10)  # looks again soon
    assert statuses(sessions, [waiting]) == [(JobStatus.pending, 0)]  # not claimed

    uri = work.store.put_bytes("echo/twin", b"twin", content_type="text/plain")
    with sessions.begin() as session:
        succeed(session, [Output(making, uri, "made", work_seconds=0.0)], worker=other)
    # Had the twin ended between a claim's statement and the question of what holds the
    # job, the job, still to be made, is looked at again soon (it was left queued with no
    # message: 24 jobs of a run never done in tests/test_twins.py).
    with sessions() as session:
        assert held_until(session, [waiting]) - utcnow() < timedelta(seconds=10)
    again = deliver(
        [waiting], work, kind=GENERATE.name, sessions=sessions, worker=WORKER, settings=SETTINGS
    )
    assert (again.reused, again.done, work.ran) == ([waiting], [], [])


def test_hourly_rollups_add_up_the_hour_and_recompute_the_same(sessions) -> None:
    worker = Worker("rollup-host:1", "cpu")
    made, made_too, broken = new_run(
        sessions, *({"text": f"rollup {n}"} for n in range(3)), status=JobStatus.queued
    )
    with sessions.begin() as session:
        claim(session, [made, made_too, broken], kind=GENERATE.name, worker=worker,
              lease_seconds=60, max_attempts=2)  # fmt: skip
        outputs = [
            Output(made, "u1", "s1", work_seconds=1.5, setup_seconds=0.5, units=2),
            Output(made_too, "u2", "s2", work_seconds=2.5, units=2),
        ]
        succeed(session, outputs, worker=worker)
        fail(session, [broken], error="poison", permanent=True, settings=SETTINGS, worker=worker)

    assert roll_up(sessions) >= 1
    first = rollups_of(sessions, worker)
    assert roll_up(sessions) >= 1  # twice in a row: recomputed, not added again
    assert rollups_of(sessions, worker) == first
    hour = utcnow().replace(minute=0, second=0, microsecond=0)
    assert first == [
        {"hour": hour, "kind": "generate", "model": "", "jobs": 2, "cached": 0, "units": 4,
         "setup_seconds": 0.5, "work_seconds": 4.0, "failures": 1}
    ]  # fmt: skip


def rollups_of(sessions, worker: Worker) -> list[dict[str, Any]]:
    with sessions() as session:
        rows = session.scalars(select(HourlyRollup).where(HourlyRollup.worker == worker.host))
        return [
            {
                "hour": as_utc(row.hour),
                **{column: getattr(row, column) for column in ROLLUP_FIGURES},
            }
            for row in rows
        ]


ROLLUP_FIGURES = ("kind", "model", "jobs", "cached", "units", "setup_seconds", "work_seconds",
                  "failures")  # fmt: skip


def through_proxy(database_url: str, proxy: OutageProxy) -> sessionmaker[Session]:
    url = make_url(database_url)
    return session_factory(make_engine(url.set(host="127.0.0.1", port=proxy.port)))


def delivered_through_an_outage(
    database_url: str,
    work: EchoWork,
    *,
    lease_seconds: int,
    jobs: int,
    outage: tuple[float, float],
) -> tuple[sessionmaker[Session], list[int], Outcome]:
    """A message of `jobs` half-second jobs delivered with Postgres unreachable for a while
    (`outage`: from, for how long, in seconds of the work), through a proxy the test takes
    down. Timed from the work's start, not the delivery's: on a busy machine the claim
    before it can take past the outage's start, which would then cut the claim instead."""
    settings = JobSettings(lease_seconds=lease_seconds, max_attempts=2)
    after, seconds = outage
    with OutageProxy(make_url(database_url).port or 5432) as proxy:
        sessions = through_proxy(database_url, proxy)
        job_ids = new_run(sessions, *({"text": f"outage {after} {n}", "seconds": 0.5}
                                      for n in range(jobs)))  # fmt: skip

        def cut() -> None:
            work.started.wait(60)
            time.sleep(after)
            proxy.outage()
            time.sleep(seconds)
            proxy.restore()

        cutting = threading.Thread(target=cut)
        cutting.start()
        outcome = deliver(job_ids, work, kind=GENERATE.name, sessions=sessions, worker=WORKER,
                          settings=settings)  # fmt: skip
        cutting.join()
    return sessions, job_ids, outcome


def test_leases_outlive_a_short_database_outage(migrated_postgres, work: EchoWork) -> None:
    """Postgres unreachable for 2 s of a 6 s lease, while a message's 8 s of jobs are
    worked on: the renewals that fail are tried again, the lease is renewed once it is
    back, and every job is done once, by this worker, on its first attempt (the renewal
    thread used to end at its first error, and the lease with it)."""
    sessions, job_ids, outcome = delivered_through_an_outage(
        migrated_postgres, work, lease_seconds=6, jobs=16, outage=(1.0, 2.0)
    )
    assert outcome.done == job_ids and work.ran == job_ids and outcome.error is None
    assert statuses(sessions, job_ids) == [(JobStatus.succeeded, 1)] * len(job_ids)


@pytest.mark.slow
def test_a_renewal_is_tried_every_second_while_the_database_is_gone(
    migrated_postgres, work: EchoWork
) -> None:
    """Postgres unreachable from 9 s to 26 s of a message's work under a 24 s lease, renewed
    every 8 s and held while renewed within 21.6 s (the last renewal before the outage at
    about 8.2 s): the renewal that fails is tried again every second, not with a backoff
    that grows past the lease (0.5, 1, 2, 4 s, then the period: its try at 23.7 s fell
    within the outage and the next at 31.7 s came after the lease was given up at 29.8 s,
    and live work was redone), so the lease is renewed as soon as the database is back and
    every job is done once, on its first attempt."""
    sessions, job_ids, outcome = delivered_through_an_outage(
        migrated_postgres, work, lease_seconds=24, jobs=64, outage=(9.0, 17.0)
    )
    assert outcome.error is None and outcome.done == job_ids
    assert statuses(sessions, job_ids) == [(JobStatus.succeeded, 1)] * len(job_ids)


def test_a_worker_that_cannot_renew_its_lease_stops_instead_of_working_on(
    migrated_postgres, work: EchoWork
) -> None:
    """Postgres unreachable for longer than the lease: the jobs may be another worker's by
    now, so the work stops at its next output, and nothing more is written or failed."""
    sessions, job_ids, outcome = delivered_through_an_outage(
        migrated_postgres, work, lease_seconds=3, jobs=12, outage=(0.5, 4.0)
    )
    assert outcome.error.startswith("LeaseLost") and outcome.retry == []
    assert len(work.ran) < len(job_ids)  # stopped, not finished
    left = statuses(sessions, job_ids)[len(outcome.done) :]
    assert left and all(status == JobStatus.running for status, _ in left)  # for the sweep


def test_leases_are_set_and_judged_by_the_database_s_clock(migrated_postgres, monkeypatch) -> None:
    """A worker whose clock is five minutes behind claims a job: its lease still runs a
    lease's length by the database's clock, so another worker (and the sweep) finds it
    held, not run out; and its renewals keep it so."""
    sessions = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(sessions, {"text": "a skewed clock"}, status=JobStatus.queued)
    behind = utcnow() - timedelta(minutes=5)
    with monkeypatch.context() as skewed:
        skewed.setattr(lifecycle, "utcnow", lambda: behind)
        with sessions.begin() as session:
            assert claim(session, [job_id], kind=GENERATE.name, worker=WORKER,
                         lease_seconds=60, max_attempts=2)  # fmt: skip
            extend_leases(session, [job_id], worker=WORKER, lease_seconds=60)
    with sessions() as session:
        left = session.scalar(
            select(Job.lease_expires_at - func.now()).where(Job.id == job_id)
        ).total_seconds()
    assert 50 < left <= 60
    with sessions.begin() as session:
        taken = claim(session, [job_id], kind=GENERATE.name, worker=Worker("other:2", "cpu"),
                      lease_seconds=60, max_attempts=2)  # fmt: skip
    sweep_leases(sessions, SETTINGS)
    assert taken == []
    assert statuses(sessions, [job_id]) == [(JobStatus.running, 1)]
