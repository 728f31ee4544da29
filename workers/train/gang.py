"""A train-shard job over several machines, gathered through Postgres. The worker that
claims the job leads: it records node 0 of a new gathering of the job's gang with the
address its rank 0 will listen on, and calls for the other nodes with join messages on the
train queue. A worker that takes one records the next node of that gathering and starts its
ranks against that address; torch.distributed's own rendezvous (its TCP store, env://) does
the rest.

The gang goes on from job to job: every node keeps its ranks (their process group, model
and state) after a job, the run's next job comes back to its leader (models/train/
routing.py), and the leader's gathering for it keeps the same rendezvous and calls each
member on a queue of its own (its place in the run's gang) to go on with its ranks. A
member that cannot (its ranks are gone) does not join, and the gathering fails as an
outage; so does one that the leader's own ranks cannot go on with. The job then gathers
anew, with new ranks on every node.

Nothing waits for ever, and a lost node costs the job no attempt. While their ranks run,
the nodes note every second that they are seen (by the database's clock, so no machine's
own clock matters) and watch the others: a node unseen for `node_timeout_seconds` (its
machine or worker died, in the rendezvous or mid-job) fails the gathering as an outage
within seconds, as does a gang that has not gathered in time; the job is sent again, goes
on from its last checkpoint, and gathers anew under the next number. A member stops its
ranks as soon as the job has left the gathering it joined.
"""

import logging
import socket
from collections.abc import Callable
from datetime import timedelta
from time import monotonic, sleep
from typing import TYPE_CHECKING, Protocol

from sqlalchemy import func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import upsert
from sdq.models.jobs.delivery import check_lease
from sdq.models.settings import TrainSettings
from sdq.models.tables import Job, JobStatus
from sdq.models.train.specs import TrainShardSpec
from sdq.models.train.tables import TrainGang
from sdq.workers.train.ranks import WATCH_SECONDS, Node, RankFailed, free_port

if TYPE_CHECKING:  # work.py leads gangs through this module
    from sdq.workers.train.work import LiveStates

logger = logging.getLogger(__name__)


class GangCalls(Protocol):
    """The join messages of a job's gathering (workers/train/task.py)."""

    def new_nodes(self, job_id: int, gathering: int, count: int) -> None:
        """Calls for that many nodes on the train queue."""

    def kept_members(self, job_id: int, gathering: int, run_id: int, nodes: int) -> None:
        """Calls each member node of the run's gang to go on, on its own queue."""


class GangIncomplete(Exception):
    """Too few nodes answered the job's call in time: not the job's fault, so it is retried
    as an outage (without spending an attempt) while the outage budget lasts."""


class NodeLost(GangIncomplete):
    """A node of the gang stopped being seen: its machine or its worker died."""


class AttemptOver(Exception):
    """The gathering this node joined has ended (failed, or led by nobody any more)."""


def node_address(settings: TrainSettings) -> str:
    return settings.node_address or socket.gethostbyname(socket.gethostname())


def lead(
    sessions: sessionmaker[Session],
    job: Job,
    *,
    worker: str,
    settings: TrainSettings,
    node: Node | None = None,
) -> tuple[Node, int]:
    """Node 0 of a new gathering of the job's gang, recorded with its rendezvous address
    (the kept `node`'s, for a gang that goes on); and the gathering's number."""
    if node is None:
        address = node_address(settings)
        node = Node(0, address, free_port(address))
    with sessions.begin() as session:
        gathering = 1 + (_newest(session, job.id) or 0)
        session.add(
            TrainGang(
                job_id=job.id,
                gathering=gathering,
                node=0,
                worker=worker,
                address=node.rendezvous,
                seen_at=func.now(),
            )
        )
    return node, gathering


def leader_watch(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    *,
    nodes: int,
    settings: TrainSettings,
    call_nodes: Callable[[int], None] | None,
) -> Callable[[], None]:
    """The leader's watch, called about once a second while its ranks run: calls for the
    nodes still missing every RECALL_SECONDS (a call can be taken by a worker that cannot
    answer it yet: Redis hands a message to a worker's pending fetch, the leader's own
    included, while it waits for a retry's countdown); raises GangIncomplete once the gang
    has not gathered by the deadline (the ranks' rendezvous would otherwise wait out the
    collective timeout), and NodeLost once a node is unseen. Without `call_nodes` the gang
    goes on from the run's last job: its members, called once on their own queues, answer
    within seconds or not at all."""
    seconds = settings.gang_timeout_seconds if call_nodes else going_on_seconds(settings)
    deadline = monotonic() + seconds
    called = monotonic()
    database = Sightings(settings)

    def watch() -> None:
        nonlocal called
        joined = database.look(sessions, job_id, gathering, 0)
        if joined is None:
            return
        if joined < nodes and monotonic() >= deadline:
            what = (
                f"gathered in {seconds} s: start more train workers (`sdq worker gpu "
                "--train-ranks N`) or lower --nodes"
                if call_nodes
                else f"went on from the run's last job within {seconds} s: it gathers anew"
            )
            raise GangIncomplete(f"{joined} of the {nodes} nodes of job {job_id}'s gang {what}")
        if call_nodes and joined < nodes and monotonic() - called >= RECALL_SECONDS:
            call_nodes(nodes - joined)
            called = monotonic()

    return watch


# How often a leader calls again for the nodes its gang still misses. A call answered late
# finds its gathering full or over, and does nothing.
RECALL_SECONDS = 10


def going_on_seconds(settings: TrainSettings) -> float:
    """How long a gang that goes on waits for its members: a member's worker, idle since
    its last part, answers at once; one that has died never does, and its node's timeout
    (and a call's delivery) is long enough to tell."""
    return settings.node_timeout_seconds + RECALL_SECONDS


def member_watch(
    sessions: sessionmaker[Session], job_id: int, gathering: int, node: int, settings: TrainSettings
) -> Callable[[], None]:
    """A member's watch: raises AttemptOver once the job has left this gathering, or a
    node of it (the leader too) is unseen."""
    database = Sightings(settings)

    def watch() -> None:
        try:
            database.look(sessions, job_id, gathering, node, ongoing=True)
        except NodeLost as lost:
            raise AttemptOver(str(lost)) from lost

    return watch


class Sightings:
    """A node's ticks against the database: each notes the node seen and looks at the
    others. A database error passes (logged: the ranks go on without it, and the next tick
    looks again; a leader's lease decides when an outage has lasted too long), and after
    one, the others are judged only once this node has ticked a while again: none of them
    could note itself meanwhile either."""

    def __init__(self, settings: TrainSettings) -> None:
        self.settings = settings
        # When the ticks last came back from a database error: none yet.
        self.since = float("-inf")

    def look(
        self,
        sessions: sessionmaker[Session],
        job_id: int,
        gathering: int,
        node: int,
        *,
        ongoing: bool = False,
    ) -> int | None:
        """How many nodes have joined, None when the database could not say; raises
        AttemptOver (with `ongoing`) once the job has left the gathering, NodeLost once
        another node is unseen."""
        try:
            judged = monotonic() - self.since >= SETTLE_TICKS * WATCH_SECONDS
            return _seen_and_lost(
                sessions, job_id, gathering, node, self.settings, judged, ongoing=ongoing
            )
        except DBAPIError as error:
            logger.warning("job %s's gang could not reach the database: %r", job_id, error)
            self.since = monotonic()
            return None


# Ticks after a database error before other nodes' sightings are judged again.
SETTLE_TICKS = 3


def _seen_and_lost(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    node: int,
    settings: TrainSettings,
    judged: bool = True,
    *,
    ongoing: bool = False,
) -> int:
    """In one transaction: raises AttemptOver (with `ongoing`) once the job has left the
    gathering; notes that `node` is seen now; raises NodeLost if another is not (when
    `judged`); returns how many nodes have joined."""
    with sessions.begin() as session:
        if ongoing and not _ongoing(session, job_id, gathering):
            raise AttemptOver(f"job {job_id}'s gathering {gathering} is over")
        here = (TrainGang.job_id == job_id, TrainGang.gathering == gathering)
        session.execute(
            update(TrainGang).where(*here, TrainGang.node == node).values(seen_at=func.now())
        )
        unseen = TrainGang.seen_at < func.now() - timedelta(seconds=settings.node_timeout_seconds)
        rows = session.execute(select(TrainGang.node, unseen).where(*here)).all()
    lost = sorted(index for index, stale in rows if stale)
    if lost and judged:
        raise NodeLost(
            f"node {lost[0]} of job {job_id}'s gang (gathering {gathering}) has not been seen "
            f"for {settings.node_timeout_seconds} s: its machine or worker is gone"
        )
    return len(rows)


def lost_node(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    settings: TrainSettings,
    going_on: int | None = None,
) -> NodeLost | None:
    """After the leader's ranks failed: whether a node was lost (a dead peer breaks every
    collective), told apart from the job's own failure by waiting until a dead node's last
    sighting is old enough to say so. In a gang `going_on` from its last job (of that many
    nodes), a member that has not joined is lost too: its ranks were already in the group,
    and died with its worker."""
    deadline = monotonic() + settings.node_timeout_seconds + 2 * WATCH_SECONDS
    while True:
        try:
            joined = _seen_and_lost(sessions, job_id, gathering, 0, settings)
        except NodeLost as lost:
            return lost
        if going_on is not None and joined < going_on:
            return NodeLost(
                f"{going_on - joined} member node(s) of job {job_id}'s gang did not go on with "
                f"it from the run's last job (gathering {gathering}): its ranks are gone"
            )
        if monotonic() >= deadline:
            return None
        sleep(WATCH_SECONDS)


def join(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    *,
    nodes: int,
    worker: str,
    settings: TrainSettings,
    place: Node | None = None,
) -> Node | None:
    """This worker's node in the gathering, or None when it is over or full; at its kept
    `place` in the gang (which the gathering's rendezvous must be) for a gang that goes
    on."""
    with sessions.begin() as session:
        if not _ongoing(session, job_id, gathering):
            return None
        leader = session.get(TrainGang, (job_id, gathering, 0))
        if leader is None:
            return None
        if place is not None and leader.address != place.rendezvous:
            return None
        for index in range(1, nodes) if place is None else [place.index]:
            taken = session.execute(
                upsert(session, TrainGang)
                .values(
                    job_id=job_id,
                    gathering=gathering,
                    node=index,
                    worker=worker,
                    address=node_address(settings),
                    seen_at=func.now(),
                )
                .on_conflict_do_nothing()
                .returning(TrainGang.node)
            ).first()
            if taken is not None:
                host, _, port = leader.address.rpartition(":")
                return Node(index, host, int(port))
    return None


def _ongoing(session: Session, job_id: int, gathering: int) -> bool:
    """Whether the job runs, and this is its newest gathering."""
    job = session.get(Job, job_id)
    running = job is not None and job.status == JobStatus.running
    return running and _newest(session, job_id) == gathering


def _newest(session: Session, job_id: int) -> int | None:
    return session.scalar(select(func.max(TrainGang.gathering)).where(TrainGang.job_id == job_id))


def run_as_leader(
    sessions: sessionmaker[Session],
    job: Job,
    spec: TrainShardSpec,
    *,
    worker: str,
    settings: TrainSettings,
    calls: GangCalls,
    ranks: "LiveStates",
    stop_at: float | None,
) -> dict:
    """Node 0 of a new gathering of the job's gang, and its ranks, stopped if the job's
    lease is lost; a failure that a lost node caused is an outage. Where this worker's
    ranks are node 0 of the run's gang kept from its last job, the gang goes on with
    them: the same rendezvous, each member called to go on with its own."""
    kept = ranks.kept_gang_node(spec)
    goes_on = kept is not None and kept.index == 0
    node, gathering = lead(
        sessions, job, worker=worker, settings=settings, node=kept if goes_on else None
    )
    nodes = spec.options.nodes
    if goes_on:
        calls.kept_members(job.id, gathering, spec.run, nodes)
        call_nodes = None
    else:
        calls.new_nodes(job.id, gathering, nodes - 1)

        def call_nodes(count: int) -> None:
            calls.new_nodes(job.id, gathering, count)

    gang_watch = leader_watch(
        sessions, job.id, gathering, nodes=nodes, settings=settings, call_nodes=call_nodes
    )

    def watch() -> None:
        check_lease()
        gang_watch()

    try:
        return ranks.run_gang_node(spec, node, watch, stop_at, goes_on)
    except RankFailed as failure:
        lost = lost_node(sessions, job.id, gathering, settings, nodes if goes_on else None)
        if lost is not None:
            raise lost from failure
        raise


def take_part(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    *,
    worker: str,
    settings: TrainSettings,
    ranks: "LiveStates",
    goes_on: bool = False,
) -> str:
    """Runs this worker's node of the job's gathering (with its ranks kept from the run's
    last job, where the gang `goes_on`); says what became of it. Its ranks' failure is the
    leader's to record: the job fails through the leader's ranks, whose collectives break
    with this node's."""
    with sessions() as session:
        job = session.get(Job, job_id)
        spec = TrainShardSpec.from_dict(job.spec) if job is not None else None
    if spec is None:
        return f"no job {job_id}"
    if refusal := settings.too_many_ranks(spec.run, spec.options.ranks_per_node):
        return f"not joined: {refusal}"  # the leader calls again, for another worker
    place = ranks.kept_gang_node(spec) if goes_on else None
    if goes_on and place is None:
        return f"not joined: no ranks of run {spec.run}'s gang are kept here to go on with"
    node = join(sessions, job_id, gathering, nodes=spec.options.nodes, worker=worker,
                settings=settings, place=place)  # fmt: skip
    if node is None:
        return f"job {job_id}'s gathering {gathering} is over or full, or not ours to go on"
    try:
        watch = member_watch(sessions, job_id, gathering, node.index, settings)
        ranks.run_gang_node(spec, node, watch, None, goes_on)
    except (RankFailed, AttemptOver) as error:
        return f"node {node.index} of job {job_id} stopped: {error}"
    if spec.last_step == spec.options.steps:
        ranks.run_ended(settings.ranks or spec.options.ranks_per_node)
    return f"node {node.index} of job {job_id} done"
