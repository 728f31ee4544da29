"""Any other node of a job's gang: joining a gathering (at its kept place, for a gang that
goes on) and watching it while its ranks run."""

from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from sdq.models.tables import Job
from sdq.models.train.settings import TrainSettings
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.train.gang.gathering import AttemptOver, NodeLost, Sightings, join
from sdq.workers.train.loop.diverged import Diverged
from sdq.workers.train.ranks.live import LiveStates
from sdq.workers.train.ranks.processes import RankFailed, too_many_here


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


def take_part(
    sessions: sessionmaker[Session],
    job_id: int,
    gathering: int,
    *,
    worker: str,
    settings: TrainSettings,
    ranks: LiveStates,
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
    if refusal := too_many_here(settings, spec):
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
    except (RankFailed, AttemptOver, Diverged) as error:  # the leader records the job's end
        return f"node {node.index} of job {job_id} stopped: {error}"
    if spec.last_step == spec.options.steps:
        ranks.clear()  # the run's ranks let their devices go
    return f"node {node.index} of job {job_id} done"
