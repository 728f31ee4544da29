"""A gathering of a job's gang as Postgres records it: each node's row (its place, worker
and rendezvous), when each was last seen, and who is lost."""

import logging
import socket
from datetime import timedelta
from time import monotonic, sleep

from sqlalchemy import func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import upsert
from sdq.models.tables import Job, JobStatus
from sdq.models.train.settings import TrainSettings
from sdq.models.train.tables import TrainGang
from sdq.workers.train.ranks.processes import WATCH_SECONDS, Node, free_port

logger = logging.getLogger(__name__)


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
    *,
    nodes: int,
    going_on: bool = False,
) -> GangIncomplete | None:
    """After the leader's ranks failed: whether the gang was at fault, not the job. A gang
    of `nodes` that had not all joined never completed its rendezvous, whichever timed out
    first (torch.distributed's store or the leader's watch); in a gang `going_on` from its
    last job, a member that has not joined is lost (its ranks were already in the group, and
    died with its worker). Else a node may have died mid-job (a dead peer breaks every
    collective), told apart from the job's own failure by waiting until a dead node's last
    sighting is old enough to say so."""
    deadline = monotonic() + settings.node_timeout_seconds + 2 * WATCH_SECONDS
    while True:
        try:
            joined = _seen_and_lost(sessions, job_id, gathering, 0, settings)
        except NodeLost as lost:
            return lost
        if joined < nodes:
            return _incomplete(job_id, gathering, nodes - joined, going_on=going_on)
        if monotonic() >= deadline:
            return None
        sleep(WATCH_SECONDS)


def _incomplete(job_id: int, gathering: int, missing: int, *, going_on: bool) -> GangIncomplete:
    if going_on:
        return NodeLost(
            f"{missing} member node(s) of job {job_id}'s gang did not go on with it from the "
            f"run's last job (gathering {gathering}): its ranks are gone"
        )
    return GangIncomplete(
        f"{missing} node(s) of job {job_id}'s gang had not joined gathering {gathering} when "
        "its ranks' rendezvous gave up: the gang never gathered"
    )
