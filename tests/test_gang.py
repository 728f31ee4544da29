"""How the nodes of a train-shard job over several machines gather through Postgres: the
leader's rendezvous address, nodes taken one each, a gang that does not gather in time, a
member that learns its attempt is over."""

import pytest
from sqlalchemy import update

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.lifecycle import Worker, claim
from sdq.models.settings import TrainSettings
from sdq.models.tables import Job, JobStatus
from sdq.workers.train.gang import (
    AttemptOver,
    GangIncomplete,
    gathered_in_time,
    join,
    lead,
    still_on,
)
from sdq.workers.train.ranks import Node
from sdq.workers.train.work import TrainWork
from tests.test_jobs import new_run

SETTINGS = TrainSettings(node_address="127.0.0.1")


def test_a_gang_gathers_once_per_attempt_and_nothing_waits_for_ever(migrated_postgres) -> None:
    sessions = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(sessions, {"text": "a train-shard job"}, status=JobStatus.queued)
    with sessions.begin() as session:
        [job] = claim(session, [job_id], worker=Worker("a:1", "cpu"), lease_seconds=60,
                      max_attempts=3)  # fmt: skip
    leader = lead(sessions, job, worker="a:1", settings=SETTINGS)
    assert (leader.index, leader.master_address) == (0, "127.0.0.1")

    def joined(worker: str) -> Node | None:
        return join(sessions, job_id, 1, nodes=3, worker=worker, settings=SETTINGS)

    assert joined("b:2") == Node(1, "127.0.0.1", leader.master_port)
    # Two of three nodes: the leader's watch gives up at its deadline, as an outage.
    with pytest.raises(GangIncomplete, match="2 of the 3 nodes of job"):
        gathered_in_time(sessions, job, nodes=3, timeout_seconds=0)()
    assert GangIncomplete in TrainWork.outage_errors
    assert joined("c:3") == Node(2, "127.0.0.1", leader.master_port)
    assert joined("d:4") is None  # the gang is full
    gathered_in_time(sessions, job, nodes=3, timeout_seconds=0)()  # all there: no error

    member_watch = still_on(sessions, job_id, 1)
    member_watch()  # the attempt goes on
    with sessions.begin() as session:  # the leader failed the attempt
        session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.queued))
    with pytest.raises(AttemptOver, match="attempt 1 is over"):
        member_watch()
    assert joined("e:5") is None  # a late call to join an attempt that is over
