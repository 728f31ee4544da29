"""What a curate worker keeps on its device between tasks (models/jobs/kinds.py
WorkerHooks): its CLIP model and heads."""

from sdq.models.jobs.kinds import WorkerHooks
from sdq.workers.curate.task import scorers

HOOKS = WorkerHooks(holds=scorers)
