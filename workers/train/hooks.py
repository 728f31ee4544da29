"""What a train worker does besides its tasks (models/jobs/kinds.py WorkerHooks): it keeps
the run it last trained, and a worker of several GPUs starts its rank fork server before
its first job."""

from sdq.models.jobs.kinds import WorkerHooks
from sdq.workers.train.task import follow_the_run, live_states, warm_up, warms

HOOKS = WorkerHooks(
    holds=lambda app: live_states(), warms=warms, warm_up=warm_up, follow=follow_the_run
)
