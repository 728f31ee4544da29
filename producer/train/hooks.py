"""What the train kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks)."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.train.cli import COMMANDS, train_here, watch_resumed
from sdq.producer.train.lookups import spec_fields
from sdq.producer.train.metrics import train_gauges
from sdq.producer.train.screens import report_status

HOOKS = ProducerHooks(commands=COMMANDS, resume_here=train_here, watch=watch_resumed,
                      report_run=report_status, spec_fields=spec_fields,
                      metrics=train_gauges)  # fmt: skip
