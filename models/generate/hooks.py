"""What the generate kind gives the generic layers (models/jobs/kinds.py): its settings, and
the warm key that routes a job to a worker with its shape compiled."""

from sdq.models.generate.routing import warm_routing
from sdq.models.generate.settings import GenerateSettings
from sdq.models.jobs.kinds import ModelHooks

HOOKS = ModelHooks(settings=GenerateSettings, warm_routing=warm_routing)
