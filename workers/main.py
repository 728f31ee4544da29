"""Entry point for the Celery command line: `celery -A sdq.workers.main worker -Q generate`."""

from sdq.models.settings import Settings
from sdq.workers import memory  # noqa: F401  (registers the device_memory control command)
from sdq.workers.app import create_app, quiet_libraries

quiet_libraries()
app = create_app(Settings.from_env())
