"""What the curate kind adds to the command line and the generic listings
(models/jobs/kinds.py ProducerHooks): its commands, `sdq dataset filter`, and each
dataset's scores in `sdq dataset show`."""

from sdq.models.jobs.kinds import ProducerHooks
from sdq.producer.curate.cli import COMMANDS, filter_command
from sdq.producer.curate.lookups import spec_fields
from sdq.producer.curate.scores import scores_html, scores_of, show_scores

HOOKS = ProducerHooks(
    commands=COMMANDS,
    dataset_commands=(filter_command,),
    spec_fields=spec_fields,
    dataset_summary=scores_of,
    show_dataset=show_scores,
    dataset_page=scores_html,
)
