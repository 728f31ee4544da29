"""What a generate worker does besides its task (models/jobs/kinds.py WorkerHooks): it keeps
its pipelines loaded, warms SDQ_WARM_MODELS up before it takes a job, and once a run is
done beat writes its gallery (a run submitted without --wait has its page without anyone
asking)."""

from sdq.models.generate.galleries import write_gallery
from sdq.models.jobs.kinds import WorkerHooks
from sdq.workers.generate.task import follow_warm_queues, pipelines, warm_up, warms

HOOKS = WorkerHooks(
    holds=pipelines,
    at_run_end=write_gallery,
    warms=warms,
    warm_up=warm_up,
    follow=follow_warm_queues,
)
