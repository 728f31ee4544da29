"""What the download kind gives the generic layers (models/jobs/kinds.py): its settings."""

from sdq.models.download.settings import DownloadSettings
from sdq.models.jobs.kinds import ModelHooks

HOOKS = ModelHooks(settings=DownloadSettings)
