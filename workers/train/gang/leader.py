"""Node 0 of a job's gang: the gathering it leads, the calls for the other nodes, its watch
over them while its ranks run."""

from collections.abc import Callable
from functools import partial
from time import monotonic
from typing import Protocol

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.jobs.delivery import check_lease
from sdq.models.tables import Job
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.train.gang.gathering import GangIncomplete, Sightings, lead, lost_node
from sdq.workers.train.ranks.live import LiveStates
from sdq.workers.train.ranks.processes import RankFailed


class GangCalls(Protocol):
    """The join messages of a job's gathering (workers/train/task.py)."""

    def new_nodes(self, job_id: int, gathering: int, count: int) -> None:
        """Calls for that many nodes on the train queue."""

    def kept_members(self, job_id: int, gathering: int, run_id: int, nodes: int) -> None:
        """Calls each member node of the run's gang to go on, on its own queue."""


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


def run_as_leader(
    sessions: sessionmaker[Session],
    job: Job,
    spec: TrainShardSpec,
    *,
    worker: str,
    settings: TrainSettings,
    calls: GangCalls,
    ranks: LiveStates,
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
    call_nodes = _call(calls, job.id, gathering, spec.run, nodes, goes_on=goes_on)
    gang_watch = leader_watch(
        sessions, job.id, gathering, nodes=nodes, settings=settings, call_nodes=call_nodes
    )

    def watch() -> None:
        check_lease()
        gang_watch()

    try:
        return ranks.run_gang_node(spec, node, watch, stop_at, goes_on)
    except RankFailed as failure:
        lost = lost_node(sessions, job.id, gathering, settings, nodes=nodes, going_on=goes_on)
        if lost is not None:
            raise lost from failure
        raise


def _call(
    calls: GangCalls, job_id: int, gathering: int, run_id: int, nodes: int, *, goes_on: bool
) -> Callable[[int], None] | None:
    """Calls the gathering's other nodes: each member of the run's kept gang on its own
    queue, once, where the gang `goes_on`; else new nodes on the train queue, and returns
    how to call for more."""
    if goes_on:
        calls.kept_members(job_id, gathering, run_id, nodes)
        return None
    calls.new_nodes(job_id, gathering, nodes - 1)
    return partial(calls.new_nodes, job_id, gathering)
