"""What an encode worker keeps on its device between tasks (models/jobs/kinds.py
WorkerHooks): its VAE and text encoders."""

from sdq.models.jobs.kinds import WorkerHooks
from sdq.workers.encode.task import encoders

HOOKS = WorkerHooks(holds=encoders)
