"""What the evaluate kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks): `sdq evaluate`, and its jobs' fields."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.evaluate.cli import COMMANDS
from sdq.producer.evaluate.lookups import spec_fields

HOOKS = ProducerHooks(commands=COMMANDS, spec_fields=spec_fields)
