"""What the evaluate kind adds to the command line (models/jobs/kinds.py ProducerHooks):
`sdq evaluate`."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.evaluate.cli import COMMANDS

HOOKS = ProducerHooks(commands=COMMANDS)
