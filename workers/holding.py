"""What a worker process holds on its device, by kind of work. A GPU process serves the
generate, encode and train queues in turn, and keeps each kind's models loaded for its
next task; before a task of another kind loads its own, the others' are let go: a GPU has
no room for a pipeline, the encoders and a training state at once."""

from collections.abc import Callable

# Kind name -> how to let go of what it holds.
_held: dict[str, Callable[[], None]] = {}


def hold(kind: str, release: Callable[[], None]) -> None:
    """Before a task of `kind` loads anything: what the other kinds hold is let go."""
    for other in [name for name in _held if name != kind]:
        _held.pop(other)()
    _held[kind] = release
