"""A train-shard job over several machines, gathered through Postgres. The worker that
claims the job leads: it records node 0 of a new gathering of the job's gang with the
address its rank 0 will listen on, and calls for the other nodes with join messages on the
train queue. A worker that takes one records the next node of that gathering and starts its
ranks against that address; torch.distributed's own rendezvous (its TCP store, env://) does
the rest.

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

logger = logging.getLogger(__name__)


# Runs this node's ranks of a job (spec, node, watch, stop_at): returns what rank 0 wrote,
# on node 0 (LiveStates.run_gang_node).
RunNode = Callable[[TrainShardSpec, Node, Callable[[], None], float | None], dict | None]


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
) -> tuple[Node, int]:
    """Node 0 of a new gathering of the job's gang, recorded with its rendezvous address;
    and the gathering's number."""
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
                address=f"{address}:{node.master_port}",
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
    call_nodes: Callable[[int], None],
) -> Callable[[], None]:
    """The leader's watch, called about once a second while its ranks run: calls for the
    nodes still missing every RECALL_SECONDS (a call can be taken by a worker that cannot
    answer it yet: Redis hands a message to a worker's pending fetch, the leader's own
    included, while it waits for a retry's countdown); raises GangIncomplete once the gang
    has not gathered by the deadline (the ranks' rendezvous would otherwise wait out the
    collective timeout), and NodeLost once a node is unseen."""
    deadline = monotonic() + settings.gang_timeout_seconds
    called = monotonic()
    database = Sightings(settings)

    def watch() -> None:
        nonlocal called
        joined = database.look(sessions, job_id, gathering, 0)
        if joined is None:
            return
        if joined < nodes and monotonic() >= deadline:
            raise GangIncomplete(
                f"{joined} of the {nodes} nodes of job {job_id}'s gang gathered in "
                f"{settings.gang_timeout_seconds} s: start more train workers (`sdq worker "
                f"gpu --train-ranks N`) or lower --nodes"
            )
        if joined < nodes and monotonic() - called >= RECALL_SECONDS:
            call_nodes(nodes - joined)
            called = monotonic()

    return watch


# How often a leader calls again for the nodes its gang still misses. A call answered late
# finds its gathering full or over, and does nothing.
RECALL_SECONDS = 10


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
    sessions: sessionmaker[Session], job_id: int, gathering: int, settings: TrainSettings
) -> NodeLost | None:
    """After the leader's ranks failed: whether a node was lost (a dead peer breaks every
    collective), told apart from the job's own failure by waiting until a dead node's last
    sighting is old enough to say so."""
    deadline = monotonic() + settings.node_timeout_seconds + 2 * WATCH_SECONDS
    while True:
        try:
            _seen_and_lost(sessions, job_id, gathering, 0, settings)
        except NodeLost as lost:
            return lost
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
) -> Node | None:
    """This worker's node in the gathering, or None when it is over or full."""
    with sessions.begin() as session:
        if not _ongoing(session, job_id, gathering):
            return None
        leader = session.get(TrainGang, (job_id, gathering, 0))
        if leader is None:
            return None
        for index in range(1, nodes):
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
    spec: TrainShardSpec,
    job_id: int,
    gathering: int,
    node: Node,
    settings: TrainSettings,
    stop_at: float | None,
    call_nodes: Callable[[int], None],
    run_node: RunNode,
) -> dict:
    """Node 0's ranks of the gathering, stopped if the job's lease is lost; a failure that
    a lost node caused is an outage."""
    gang_watch = leader_watch(
        sessions,
        job_id,
        gathering,
        nodes=spec.options.nodes,
        settings=settings,
        call_nodes=call_nodes,
    )

    def watch() -> None:
        check_lease()
        gang_watch()

    try:
        return run_node(spec, node, watch, stop_at)
    except RankFailed as failure:
        lost = lost_node(sessions, job_id, gathering, settings)
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
    run_node: RunNode,
) -> str:
    """Runs this worker's node of the job's gathering; says what became of it.
    Its ranks' failure is the leader's to record: the job fails through the leader's ranks,
    whose collectives break with this node's."""
    with sessions() as session:
        job = session.get(Job, job_id)
        spec = TrainShardSpec.from_dict(job.spec) if job is not None else None
    if spec is None:
        return f"no job {job_id}"
    if refusal := settings.too_many_ranks(spec.run, spec.options.ranks_per_node):
        return f"not joined: {refusal}"  # the leader calls again, for another worker
    node = join(
        sessions, job_id, gathering, nodes=spec.options.nodes, worker=worker, settings=settings
    )
    if node is None:
        return f"job {job_id}'s gathering {gathering} is over or full"
    try:
        watch = member_watch(sessions, job_id, gathering, node.index, settings)
        run_node(spec, node, watch, None)
    except (RankFailed, AttemptOver) as error:
        return f"node {node.index} of job {job_id} stopped: {error}"
    return f"node {node.index} of job {job_id} done"
