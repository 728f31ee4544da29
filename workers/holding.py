"""What a worker process holds on its device, by kind of work. A GPU process serves the
generate, encode and train queues in turn, and keeps each kind's models loaded for its
next task; before a task of another kind loads its own, the others' are let go: a GPU has
no room for a pipeline, the encoders and a training state at once."""

from collections.abc import Callable

from sdq.models.jobs.kinds import Kind

# Kind name -> how to let go of what it holds.
_held: dict[str, Callable[[], None]] = {}


def hold(kind: Kind, app) -> None:
    """Before a task of `kind` loads anything: what the other kinds hold is let go, and what
    this one keeps (its WorkerHooks' `holds`) noted to be let go in turn."""
    for other in [name for name in _held if name != kind.name]:
        _held.pop(other)()
    if (holds := kind.worker_hooks().holds) is not None:
        _held[kind.name] = holds(app).clear
