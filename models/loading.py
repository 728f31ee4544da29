"""Loading a process's libraries in one go. Python's cyclic collector runs hundreds of
times while hundreds of modules load, each pass of its oldest generation walking every
object made so far; and once they are loaded (torch, diffusers and transformers make some
500,000 objects), each later full pass walks them all again: 0.25-0.27 s seen in the
middle of a rank's training steps (one rank stalling the others at the next collective),
up to 0.64 s while a rank process imported.
The modules' objects live as long as the process does, so they are set aside for good."""

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def loaded_for_good() -> Iterator[None]:
    """The block's imports made with the collector off, then frozen (left out of every
    later collection, in this process and in the children it forks); the collector is on
    again for what the process makes from then on."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
