"""What the encode kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks)."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.encode.cli import COMMANDS
from sdq.producer.encode.lookups import spec_fields

HOOKS = ProducerHooks(commands=COMMANDS, spec_fields=spec_fields)
