"""What the download kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks)."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.download.cli import COMMANDS
from sdq.producer.download.lookups import download_speed, spec_fields

HOOKS = ProducerHooks(commands=COMMANDS, spec_fields=spec_fields, dataset_summary=download_speed)
