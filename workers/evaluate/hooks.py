"""What an evaluate worker keeps on its device between tasks (models/jobs/kinds.py
WorkerHooks): the U-Net it scored last and its CLIP model."""

from sdq.models.jobs.kinds import WorkerHooks
from sdq.workers.evaluate.task import loaded_models

HOOKS = WorkerHooks(holds=loaded_models)
