"""What torch.compile made, shared through the object store: a process that compiles a model
for some shapes saves the artifacts (inductor's kernels and AOTAutograd's graphs:
`torch.compiler.save_cache_artifacts`) under a key of everything that decides them, and
every later process with the same key (another rank, job, worker or machine) loads them
before it compiles, so that its compile finds them made. GPU-side: imports torch.

Both ways are best effort: a store that fails, or artifacts another torch cannot read, cost
a compile, never the work."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._dynamo.utils import counters

from sdq.models.specs import canonical_sha256
from sdq.models.store import MissingObject, ObjectStore

logger = logging.getLogger(__name__)


def artifacts_key(kind: str, decided_by: dict[str, Any], device: torch.device) -> str:
    """The store key of a kind's artifacts, for torch's version, the device's name and the
    kind's own deciding values (architecture, shapes, dtypes, modes)."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    everything = {"torch": torch.__version__, "device": where, **decided_by}
    return f"compiled/{kind}/{canonical_sha256(everything)}.bin"


def model_architecture(model: torch.nn.Module) -> dict[str, Any]:
    """A diffusers model's config without its own records (where it was loaded from, by
    which diffusers): what its graphs are made of."""
    return {name: value for name, value in model.config.items() if name[0] != "_"}


def compile_counts() -> dict[str, int]:
    """This process's compiling so far: graphs made, and kernels found made (in the local
    cache or loaded artifacts) or compiled."""
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "kernels_found": counters["inductor"]["fxgraph_cache_hit"],
        "kernels_compiled": counters["inductor"]["fxgraph_cache_miss"],
    }


@contextmanager
def shared_through(
    store: ObjectStore, key: str, *, loads: bool = True, saves: bool = True
) -> Iterator[dict]:
    """Around a compile: the store's artifacts for `key` loaded before it (where `loads`);
    after it, the figures of what it found and compiled (the yielded dict), and what it
    compiled saved (where it compiled anything, and `saves`)."""
    figures: dict[str, Any] = {"key": key, "loaded": loads and _load(store, key)}
    compiled_before = compile_counts()["kernels_compiled"]
    yield figures
    figures.update(compile_counts())
    if saves and figures["kernels_compiled"] > compiled_before:
        _save(store, key)


def _load(store: ObjectStore, key: str) -> bool:
    """The artifacts loaded, where the store has them."""
    try:
        return torch.compiler.load_cache_artifacts(store.get_bytes(key)) is not None
    except MissingObject:
        return False
    except Exception:
        logger.exception("compiled artifacts %s not loaded: compiling instead", key)
        return False


def _save(store: ObjectStore, key: str) -> None:
    """What this process compiled, for the next: all of it so far (torch keeps one record
    a process), whatever the key; a loader finds its own kernels among them by content."""
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            store.put_bytes(key, saved[0], content_type="application/octet-stream")
    except Exception:
        logger.exception("compiled artifacts %s not saved", key)
