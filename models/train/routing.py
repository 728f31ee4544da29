"""Sending a train run's jobs to the worker that holds the run: its last job's state stays
in that worker's memory (in its own process, or in its rank processes with their process
group), and its next job goes on from there instead of restoring the checkpoint; a job over
several nodes finds its gang still gathered. Any other worker restores it from the store.

The worker that holds a run consumes a queue named by the run's warm key (workers/train/
task.py); a run's job goes to it when a live worker consumes it (workers/routing.py), and
to the train queue otherwise."""

from collections.abc import Callable
from typing import Any

from sdq.models.settings import Settings


def run_key(run_id: int) -> str:
    return f"run-{run_id}"


def node_key(run_id: int, node: int) -> str:
    """The queue key of a member node of a run's gang: where the leader calls it to go on
    with the run's next job (workers/train/gang/)."""
    return f"{run_key(run_id)}-node-{node}"


def warm_routing(settings: Settings) -> Callable[[dict[str, Any]], str]:
    """The routing hook (models/jobs/kinds.py): every train job's run."""
    return lambda spec: run_key(spec["run"])
