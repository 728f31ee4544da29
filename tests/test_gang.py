"""How the nodes of a train-shard job over several machines gather through Postgres: the
leader's rendezvous address, nodes taken one each, a gang that does not gather in time and
gathers again under a new number (no attempt spent, no collision with its last try), a node
unseen by the database's clock that fails the gathering, a member that learns its gathering
is over; a gang that goes on from its last job, its members at their places or not at
all."""

import time
from dataclasses import replace

import pytest
from sqlalchemy import make_url, text

from sdq.models.db import make_engine, session_factory
from sdq.models.jobs.claims import claim
from sdq.models.jobs.kinds import TRAIN
from sdq.models.jobs.lifecycle import Worker, fail
from sdq.models.settings import JobSettings
from sdq.models.tables import JobStatus
from sdq.models.train.settings import TrainSettings
from sdq.workers.train.gang import leader as leading
from sdq.workers.train.gang.gathering import (
    AttemptOver,
    GangIncomplete,
    NodeLost,
    join,
    lead,
    lost_node,
)
from sdq.workers.train.gang.leader import RECALL_SECONDS, going_on_seconds, leader_watch
from sdq.workers.train.gang.member import member_watch
from sdq.workers.train.ranks.processes import Node
from sdq.workers.train.work import TrainWork
from tests.services import OutageProxy
from tests.test_jobs import new_run

SETTINGS = TrainSettings(node_address="127.0.0.1", gang_timeout_seconds=0, node_timeout_seconds=5)
LEADER = Worker("a:1", "gpu")


def test_a_gang_gathers_once_per_gathering_and_nothing_waits_for_ever(
    migrated_postgres, monkeypatch
) -> None:
    sessions = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(sessions, {"text": "a train-shard job"}, status=JobStatus.queued, kind=TRAIN)
    with sessions.begin() as session:
        [job] = claim(
            session, [job_id], kind=TRAIN.name, worker=LEADER, lease_seconds=60, max_attempts=3
        )
    leader, gathering = lead(sessions, job, worker="a:1", settings=SETTINGS)
    assert (leader.index, leader.master_address, gathering) == (0, "127.0.0.1", 1)

    def joined(worker: str, number: int = 1) -> Node | None:
        return join(sessions, job_id, number, nodes=3, worker=worker, settings=SETTINGS)

    assert joined("b:2") == Node(1, "127.0.0.1", leader.master_port)
    # Two of three nodes: the leader's watch gives up at its deadline, as an outage.
    calls: list[int] = []
    watch = leader_watch(sessions, job_id, 1, nodes=3, settings=SETTINGS, call_nodes=calls.append)
    with pytest.raises(GangIncomplete, match="2 of the 3 nodes of job"):
        watch()
    assert GangIncomplete in TrainWork.outage_errors
    # Before its deadline, the leader calls again for the node still missing (a call may
    # sit with a worker that cannot answer it).
    monkeypatch.setattr(leading, "RECALL_SECONDS", 0)
    patient = replace(SETTINGS, gang_timeout_seconds=300)
    leader_watch(sessions, job_id, 1, nodes=3, settings=patient, call_nodes=calls.append)()
    assert calls == [1]
    # Its ranks failing now (torch.distributed's store gave up on the rendezvous first) is
    # the gang's outage too, whichever timed out first: the gang never gathered.
    never = lost_node(sessions, job_id, 1, SETTINGS, nodes=3)
    assert isinstance(never, GangIncomplete) and "had not joined gathering 1" in str(never)
    assert joined("c:3") == Node(2, "127.0.0.1", leader.master_port)
    assert joined("d:4") is None  # the gang is full
    watch()  # all there, all seen: no error

    member = member_watch(sessions, job_id, 1, 1, SETTINGS)
    member()  # the gathering goes on
    # The leader's outage gives the attempt back; the next claim has the same attempt
    # number, and its gathering a new one: members of the old one stop, late calls to it
    # find it over, and the new one fills.
    with sessions.begin() as session:
        fail(session, [job_id], error="gang incomplete", permanent=False, outage=True,
             settings=JobSettings(), worker=LEADER)  # fmt: skip
    with pytest.raises(AttemptOver, match="gathering 1 is over"):
        member()
    with sessions.begin() as session:
        [again] = claim(
            session, [job_id], kind=TRAIN.name, worker=LEADER, lease_seconds=60, max_attempts=3
        )
    assert again.attempts == job.attempts
    _, gathering = lead(sessions, again, worker="a:1", settings=SETTINGS)
    assert gathering == 2
    assert joined("e:5", number=1) is None
    assert joined("e:5", number=2).index == 1


def test_a_node_unseen_fails_its_gathering_as_an_outage(migrated_postgres) -> None:
    sessions = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(
        sessions, {"text": "another train-shard job"}, status=JobStatus.queued, kind=TRAIN
    )
    with sessions.begin() as session:
        [job] = claim(
            session, [job_id], kind=TRAIN.name, worker=LEADER, lease_seconds=60, max_attempts=3
        )
    _, gathering = lead(sessions, job, worker="a:1", settings=SETTINGS)
    node = join(sessions, job_id, gathering, nodes=2, worker="b:2", settings=SETTINGS)
    watch = leader_watch(
        sessions, job_id, gathering, nodes=2, settings=SETTINGS, call_nodes=lambda _: None
    )
    watch()
    member = member_watch(sessions, job_id, gathering, node.index, SETTINGS)
    member()

    def last_seen(node: int, seconds_ago: int) -> None:
        # As the database's clock has it: the nodes' own clocks play no part.
        with sessions.begin() as session:
            session.execute(
                text("UPDATE train_gangs SET seen_at = now() - make_interval(secs => :ago) "
                     "WHERE job_id = :job AND node = :node"),
                {"ago": seconds_ago, "job": job_id, "node": node},
            )  # fmt: skip

    last_seen(1, 4)
    watch()  # within the node timeout
    last_seen(1, 6)
    unseen = r"node 1 of job \d+'s gang \(gathering 1\) has not been seen for 5 s"
    with pytest.raises(NodeLost, match=unseen):
        watch()
    assert issubclass(NodeLost, GangIncomplete)  # an outage: no attempt spent
    assert "node 1" in str(lost_node(sessions, job_id, gathering, SETTINGS, nodes=2))
    last_seen(0, 6)  # and the leader, as its member sees it
    with pytest.raises(AttemptOver, match="node 0 of job"):
        member()


def test_a_gang_that_goes_on_keeps_its_rendezvous_and_each_member_its_place(
    migrated_postgres, monkeypatch
) -> None:
    """The run's next job, led by the worker whose ranks are node 0 of the gang kept from
    the last job: its gathering has the same rendezvous; a member joins only at its own
    place and only where that rendezvous is its ranks' (else it does not, and the leader
    gives up within seconds, as an outage); the leader's ranks failing with a member
    missing is that member lost."""
    sessions = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(sessions, {"text": "a gang's next job"}, status=JobStatus.queued, kind=TRAIN)
    with sessions.begin() as session:
        [job] = claim(
            session, [job_id], kind=TRAIN.name, worker=LEADER, lease_seconds=60, max_attempts=3
        )
    kept = Node(0, "127.0.0.1", 29511)
    _, gathering = lead(sessions, job, worker="a:1", settings=SETTINGS, node=kept)
    assert lead(sessions, job, worker="a:1", settings=SETTINGS)[1] == gathering + 1
    gathering += 1  # a new gathering, a new rendezvous: no member's kept ranks know it

    def go_on(place: Node, number: int) -> Node | None:
        return join(sessions, job_id, number, nodes=3, worker="c:3", settings=SETTINGS,
                    place=place)  # fmt: skip

    assert go_on(Node(2, "127.0.0.1", 29511), gathering) is None
    assert go_on(Node(2, "127.0.0.1", 29511), gathering - 1) is None  # over
    _, gathering = lead(sessions, job, worker="a:1", settings=SETTINGS, node=kept)
    assert go_on(Node(2, "127.0.0.1", 29511), gathering) == Node(2, "127.0.0.1", 29511)
    # Node 1 has not gone on. Called once on its own queue (there is no other to call),
    # it is waited for going_on_seconds, not the gang's timeout (0 s here), then given up.
    assert going_on_seconds(SETTINGS) == SETTINGS.node_timeout_seconds + RECALL_SECONDS
    leader_watch(sessions, job_id, gathering, nodes=3, settings=SETTINGS, call_nodes=None)()
    monkeypatch.setattr(leading, "going_on_seconds", lambda settings: 0)
    watch = leader_watch(sessions, job_id, gathering, nodes=3, settings=SETTINGS, call_nodes=None)
    with pytest.raises(
        GangIncomplete, match=r"2 of the 3 nodes .* went on from the run's last job within 0 s"
    ):
        watch()
    lost = lost_node(sessions, job_id, gathering, SETTINGS, nodes=3, going_on=True)
    assert "1 member node(s) of job" in str(lost) and isinstance(lost, NodeLost)


def test_a_database_outage_passes_the_gang_s_watches_by(migrated_postgres) -> None:
    """Postgres unreachable: the watches say nothing (the ranks go on), and once it is back
    the nodes are not judged lost before each has had the time to note itself again."""
    direct = session_factory(make_engine(migrated_postgres))
    [job_id] = new_run(
        direct, {"text": "a job through an outage"}, status=JobStatus.queued, kind=TRAIN
    )
    with direct.begin() as session:
        [job] = claim(session, [job_id], kind=TRAIN.name, worker=LEADER, lease_seconds=60,
                      max_attempts=3)  # fmt: skip
    _, gathering = lead(direct, job, worker="a:1", settings=SETTINGS)
    join(direct, job_id, gathering, nodes=2, worker="b:2", settings=SETTINGS)
    with OutageProxy(make_url(migrated_postgres).port or 5432) as proxy:
        sessions = session_factory(make_engine(
            make_url(migrated_postgres).set(host="127.0.0.1", port=proxy.port)))  # fmt: skip
        watch = leader_watch(sessions, job_id, gathering, nodes=2, settings=SETTINGS,
                             call_nodes=lambda _: None)  # fmt: skip
        member = member_watch(sessions, job_id, gathering, 1, SETTINGS)
        watch()
        member()
        proxy.outage()
        watch()
        member()
        proxy.restore()
        with direct.begin() as session:  # the member could not note itself meanwhile
            session.execute(
                text("UPDATE train_gangs SET seen_at = now() - make_interval(secs => 60) "
                     "WHERE job_id = :job AND node = 1"), {"job": job_id},
            )  # fmt: skip
        watch()  # back, but not judging yet
        member()
        with pytest.raises(NodeLost):
            for _ in range(100):  # judged once the leader has ticked a while again
                time.sleep(0.1)
                watch()
