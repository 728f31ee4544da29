"""A train-shard job over several machines, gathered through Postgres. The worker that
claims the job leads: it records node 0 of the attempt's gang with the address its rank 0
will listen on, and calls for the other nodes with join messages on the train queue. A
worker that takes one records the next node of the gang and starts its ranks against that
address; torch.distributed's own rendezvous (its TCP store, env://) does the rest.

Nothing waits for ever: a gang that has not gathered in time fails the attempt as an
outage; a node whose ranks die breaks the others' collectives (gloo and NCCL notice a closed
peer, and every collective has a timeout), which fails the attempt; the job is sent again
and goes on from its last checkpoint with a new gang. A member stops its ranks as soon as
the attempt it joined is over.
"""

import socket
from collections.abc import Callable
from time import monotonic

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from sdq.models.db import upsert
from sdq.models.settings import TrainSettings
from sdq.models.tables import Job, JobStatus
from sdq.models.tables.train import TrainGang
from sdq.models.training import TrainShardSpec
from sdq.workers.train.ranks import Node, RankFailed, free_port, run_ranks


class GangIncomplete(Exception):
    """Too few nodes answered the job's call in time: not the job's fault, so it is retried
    as an outage (without spending an attempt) while the outage budget lasts."""


class AttemptOver(Exception):
    """The attempt this node joined has ended (failed, or led by nobody any more)."""


def node_address(settings: TrainSettings) -> str:
    return settings.node_address or socket.gethostbyname(socket.gethostname())


def lead(
    sessions: sessionmaker[Session],
    job: Job,
    *,
    worker: str,
    settings: TrainSettings,
) -> Node:
    """Node 0 of the job's gang for this attempt, recorded with its rendezvous address."""
    address = node_address(settings)
    node = Node(0, address, free_port(address))
    with sessions.begin() as session:
        session.add(
            TrainGang(
                job_id=job.id,
                attempt=job.attempts,
                node=0,
                worker=worker,
                address=f"{address}:{node.master_port}",
            )
        )
    return node


def gathered_in_time(
    sessions: sessionmaker[Session], job: Job, *, nodes: int, timeout_seconds: int
) -> Callable[[], None]:
    """A watch for the leader: raises GangIncomplete once the gang has not gathered by the
    deadline (the ranks' rendezvous would otherwise wait out the collective timeout)."""
    deadline = monotonic() + timeout_seconds
    gathered = False

    def watch() -> None:
        nonlocal gathered
        if gathered or monotonic() < deadline:
            return
        with sessions() as session:
            joined = session.scalar(
                select(func.count())
                .select_from(TrainGang)
                .where(TrainGang.job_id == job.id, TrainGang.attempt == job.attempts)
            )
        if joined < nodes:
            raise GangIncomplete(
                f"{joined} of the {nodes} nodes of job {job.id}'s gang gathered in "
                f"{timeout_seconds} s: start more train workers (`sdq worker gpu "
                f"--train-ranks N`) or lower --nodes"
            )
        gathered = True

    return watch


def join(
    sessions: sessionmaker[Session],
    job_id: int,
    attempt: int,
    *,
    nodes: int,
    worker: str,
    settings: TrainSettings,
) -> Node | None:
    """This worker's node in the attempt's gang, or None when the attempt is over or its
    gang is full."""
    with sessions.begin() as session:
        if not _ongoing(session, job_id, attempt):
            return None
        leader = session.get(TrainGang, (job_id, attempt, 0))
        if leader is None:
            return None
        for index in range(1, nodes):
            taken = session.execute(
                upsert(session, TrainGang)
                .values(
                    job_id=job_id,
                    attempt=attempt,
                    node=index,
                    worker=worker,
                    address=node_address(settings),
                )
                .on_conflict_do_nothing()
                .returning(TrainGang.node)
            ).first()
            if taken is not None:
                host, _, port = leader.address.rpartition(":")
                return Node(index, host, int(port))
    return None


def still_on(sessions: sessionmaker[Session], job_id: int, attempt: int) -> Callable[[], None]:
    """A watch for a member: raises AttemptOver once the job has left this attempt."""

    def watch() -> None:
        with sessions() as session:
            if not _ongoing(session, job_id, attempt):
                raise AttemptOver(f"job {job_id}'s attempt {attempt} is over")

    return watch


def _ongoing(session: Session, job_id: int, attempt: int) -> bool:
    job = session.get(Job, job_id)
    return job is not None and job.status == JobStatus.running and job.attempts == attempt


def take_part(
    sessions: sessionmaker[Session],
    job_id: int,
    attempt: int,
    *,
    worker: str,
    settings: TrainSettings,
) -> str:
    """Runs this worker's node of the job's gang for the attempt; says what became of it.
    Its ranks' failure is the leader's to record: the job fails through the leader's ranks,
    whose collectives break with this node's."""
    with sessions() as session:
        job = session.get(Job, job_id)
        spec = TrainShardSpec.from_dict(job.spec) if job is not None else None
    if spec is None:
        return f"no job {job_id}"
    node = join(
        sessions, job_id, attempt, nodes=spec.options.nodes, worker=worker, settings=settings
    )
    if node is None:
        return f"job {job_id}'s attempt {attempt} is over or its gang is full"
    try:
        run_ranks(spec, node, still_on(sessions, job_id, attempt))
    except (RankFailed, AttemptOver) as error:
        return f"node {node.index} of job {job_id} stopped: {error}"
    return f"node {node.index} of job {job_id} done"
