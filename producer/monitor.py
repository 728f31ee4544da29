"""Flower for the deployment, with every page behind its credentials. Needs the monitor
extra (imported by `sdq flower` alone)."""

import os

from flower.views import monitor
from tornado import web

from sdq.workers.app import SdqCelery


def serve_flower(app: SdqCelery, *, port: int, credentials: str | None) -> None:
    """Runs Flower in this process until it is stopped. `credentials` (user:password, comma
    separated for more) are handed over in Flower's own variable, not on the command line
    where `ps` would show them; None serves it open."""
    # Flower leaves its Prometheus page and its health check open to anyone who can reach
    # the port; here they ask for the same credentials as every other page.
    for handler in (monitor.Metrics, monitor.Healthcheck):
        handler.get = web.authenticated(handler.get)
    os.environ.pop("FLOWER_BASIC_AUTH", None)
    if credentials:
        os.environ["FLOWER_BASIC_AUTH"] = credentials
    app.start(["flower", f"--port={port}"])
