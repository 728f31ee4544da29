"""Entry point for the Celery command line: `celery -A workers.main worker -Q generate`."""

from models.settings import Settings
from workers.app import create_app

app = create_app(Settings.from_env())
