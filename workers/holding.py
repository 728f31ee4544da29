"""What a worker process holds on its device, by kind of work. A GPU process serves the
generate, encode and train queues in turn, and keeps each kind's models loaded for its
next task; before a task of another kind loads its own, the others' are let go: a GPU has
no room for a pipeline, the encoders and a training state at once."""

from collections.abc import Callable

from sdq.models.jobs.kinds import Kind

# Kind name -> how to let go of what it holds.
_held: dict[str, Callable[[], None]] = {}


def hold(kind: str, release: Callable[[], None] | None) -> None:
    """Before a task of `kind` loads anything: what the other kinds hold is let go, and
    `release` noted as how to let go of what this one keeps, in turn."""
    for other in [name for name in _held if name != kind]:
        _held.pop(other)()
    if release is not None:
        _held[kind] = release


def hold_for(kind: Kind, app) -> None:
    """`hold` for a task of the kind, which keeps what its WorkerHooks' `holds` says."""
    holds = kind.worker_hooks().holds
    hold(kind.name, holds(app).clear if holds is not None else None)


def let_go_of_all() -> None:
    """Everything the process holds let go, as work done in a command stops. What runs on a
    thread (a train run's next steps, taken ahead) stops while the thread pools it draws on
    still take work: the interpreter's exit shuts those first, and the thread's next step
    failed on them ("cannot schedule new futures after shutdown")."""
    while _held:
        _held.popitem()[1]()
