"""What the generate kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks)."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.generate.cli import COMMANDS, report_run
from sdq.producer.generate.lookups import job_fields
from sdq.producer.generate.serve.cli import serve
from sdq.producer.generate.serve.figures import serve_metrics

HOOKS = ProducerHooks(commands=(*COMMANDS, serve), report_run=report_run, job_fields=job_fields,
                      metrics=serve_metrics)  # fmt: skip
