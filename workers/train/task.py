"""The train tasks: a message of one train-shard job id; and a call to join the gang of a
job over several nodes, as one of its nodes."""

import atexit
from functools import cache, partial
from typing import Any

from celery import shared_task

from sdq.models.jobs.kinds import TRAIN, Pool
from sdq.models.settings import Settings
from sdq.models.train.routing import node_key
from sdq.models.train.settings import TrainSettings
from sdq.workers.app import SdqCelery, worker_identity
from sdq.workers.delivery import JobTask, deliver_task
from sdq.workers.holding import hold_for
from sdq.workers.routing import consume_warm_queues
from sdq.workers.train.gang.member import take_part
from sdq.workers.train.ranks.forks import rank_server
from sdq.workers.train.ranks.live import LiveStates
from sdq.workers.train.work import TrainWork
from sdq.workers.weights import ModelFiles

JOIN_TASK = f"{TRAIN.task_name}.join"


@shared_task(bind=True, base=JobTask, name=TRAIN.task_name)
def train(self, job_ids: list[int]) -> dict[str, Any]:
    return deliver_task(self, TRAIN, job_ids, partial(train_work, self))


def train_work(task) -> TrainWork:
    """The work of a message, made as its delivery starts (deliver_task)."""
    app = task.app
    return TrainWork(
        store=app.store,
        sessions=app.sessions,
        files=ModelFiles(app.store, app.settings.model_cache_dir),
        live=live_states(),
        send_next=app.send_added_jobs(task),
        follow=partial(follow_the_run, task),
        settings=app.settings.group(TrainSettings),
        worker=worker_identity(TRAIN.pool).host,
        calls=None if task.request.is_eager else Calls(app),
        time_limit_seconds=time_limit(task),
    )


def follow_the_run(task) -> None:
    """Has this worker consume the queue of the run it holds (models/train/routing.py),
    and no other run's: its jobs (or, on a member node of its gang, the leader's calls to
    go on) come here first."""
    if not task.request.is_eager:  # done in-process (embedded): there is no worker
        consume_warm_queues(task.app, task.request.hostname, TRAIN, live_states().warm_keys())


def time_limit(task) -> float | None:
    """The limit the task runs under: the soft one (else the hard one) of the train queue
    as this process's settings have them, unless a message (from an older sender) names
    its own, which Celery obeys."""
    hard, soft = task.request.timelimit or (None, None)
    return soft or hard or task.soft_time_limit or task.time_limit


# One job's gang at a time: the message guard refuses a join naming more.
@shared_task(bind=True, base=JobTask, name=JOIN_TASK, max_job_ids=1)
def join(self, job_ids: list[int], gathering: int, goes_on: bool = False) -> dict[str, Any]:
    """This worker as one more node of that gathering of the job's gang, or, where the gang
    `goes_on` from the run's last job, as the node it was (gang/member.py)."""
    [job_id] = job_ids
    hold_for(TRAIN, self.app)
    worker, settings = worker_identity(Pool.gpu).host, self.app.settings.group(TrainSettings)
    outcome = take_part(self.app.sessions, job_id, gathering, worker=worker,
                             settings=settings, ranks=live_states(), goes_on=goes_on)  # fmt: skip
    follow_the_run(self)
    return {"outcome": outcome}


class Calls:
    """A gathering's join messages (gang.GangCalls); each runs under the joining worker's
    own limits for it (app.py), not this one's."""

    def __init__(self, app: SdqCelery) -> None:
        self.app = app

    def new_nodes(self, job_id: int, gathering: int, count: int) -> None:
        for _ in range(count):
            self._send(TRAIN.queue, job_id, gathering, goes_on=False)

    def kept_members(self, job_id: int, gathering: int, run_id: int, nodes: int) -> None:
        for node in range(1, nodes):
            self._send(TRAIN.warm_queue(node_key(run_id, node)), job_id, gathering, goes_on=True)

    def _send(self, queue: str, job_id: int, gathering: int, *, goes_on: bool) -> None:
        self.app.send_task(
            JOIN_TASK,
            args=[[job_id], gathering],
            kwargs={"goes_on": goes_on},
            queue=queue,
            time_limit=None,
            soft_time_limit=None,
        )


@cache
def live_states() -> LiveStates:
    live = LiveStates()
    # Steps taken ahead on a thread stop before the interpreter goes. A last resort: atexit
    # comes after the interpreter shut the thread pools they draw on (their next step then
    # fails, and says so); a command that did the work here lets go first (cli/here.py).
    atexit.register(live.clear)
    return live


def warms(settings: Settings) -> bool:
    """Whether a train worker starts anything before its first job (workers/main.py): the
    rank fork server of a worker of several GPUs (`--train-ranks N`)."""
    return (settings.group(TrainSettings).ranks or 1) > 1


def warm_up(app: SdqCelery, hostname: str) -> None:
    """The rank fork server, importing torch and the trainer while no run needs them."""
    rank_server()
