"""What the train kind gives the generic layers (models/jobs/kinds.py): its settings, the
routing of a run's jobs to the worker that holds the run, and the models its checkpoints
are."""

from sdq.models.jobs.kinds import ModelHooks
from sdq.models.train.models import made_model
from sdq.models.train.routing import warm_routing
from sdq.models.train.settings import TrainSettings

HOOKS = ModelHooks(settings=TrainSettings, warm_routing=warm_routing, made_model=made_model)
