"""A rank's U-Net compiled (`--compile`) by region, and what compiling made shared through
the object store. GPU-side: imports torch.

Compiled by region: each repeated block (diffusers' `compile_repeated_blocks`, the U-Net's
transformer blocks) is one graph, compiled once and reused by every block of its shapes,
where a whole-model graph compiles everything at once, anew for each process.

Shared: after a process's first step that compiled anything, rank 0 saves the artifacts (inductor's
kernels and AOTAutograd's graphs: `torch.compiler.save_cache_artifacts`) to the store
under a key of everything that decides them (torch's version, the device, the U-Net's
architecture, the step's shapes and dtypes, the precision, checkpointing, sharding), and
every later process with the same key (another rank, job, worker or machine) loads them
before its first step, so that its compile finds them made. Within a process a run's jobs
reuse the graphs: nothing compiles again."""

import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from diffusers import UNet2DConditionModel
from torch._dynamo.utils import counters

from sdq.models.specs import canonical_sha256
from sdq.models.store import MissingObject, ObjectStore
from sdq.models.train.specs import TrainShardSpec

logger = logging.getLogger(__name__)


def compile_regions(unet: UNet2DConditionModel) -> None:
    """Each repeated block compiled in place, on its first call (fullgraph: a block that
    would break into pieces fails at once instead of running slowly)."""
    unet.compile_repeated_blocks(fullgraph=True)


def artifacts_key(spec: TrainShardSpec, unet: UNet2DConditionModel, shapes: dict) -> str:
    options = spec.options
    device = next(unet.parameters()).device
    # Not the config's own records (where it was loaded from, by which diffusers).
    architecture = {name: value for name, value in unet.config.items() if name[0] != "_"}
    decided_by = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "architecture": architecture,
        "shapes": shapes,
        "precision": options.mixed_precision,
        "gradient_checkpointing": options.gradient_checkpointing,
        "sharding": options.sharding if options.sharded else None,
    }
    return f"compiled/train/{canonical_sha256(decided_by)}.bin"


@dataclass
class SharedCompile:
    """A compiled state's artifacts, loaded from the store before its first step and saved
    there after it when they were not."""

    store: ObjectStore
    stepped: bool = False
    # What the first step compiled and found made, for the log and the tests.
    figures: dict[str, Any] = field(default_factory=dict)

    @contextmanager
    def first_step(
        self,
        spec: TrainShardSpec,
        unet: UNet2DConditionModel,
        inputs,
        *,
        saves: bool,
        took: Callable[[float], None],
    ):
        """Around the state's first step, which compiles: `took` is told its seconds."""
        if self.stepped:
            yield
            return
        shapes = {
            "latents": list(inputs.latents.shape),
            "embeddings": list(inputs.embeddings.shape),
        }
        key = artifacts_key(spec, unet, shapes)
        started = perf_counter()
        loaded = self._load(key)
        yield
        self.stepped = True
        self.figures = {
            "key": key,
            "loaded": loaded,
            "graphs": counters["stats"]["unique_graphs"],
            "kernels_found": counters["inductor"]["fxgraph_cache_hit"],
            "kernels_compiled": counters["inductor"]["fxgraph_cache_miss"],
        }
        if saves and self.figures["kernels_compiled"]:
            self._save(key)
        # Loading, compiling and saving: all of it the run's start.
        self.figures["seconds"] = round(perf_counter() - started, 3)
        took(self.figures["seconds"])
        logger.info("run %s: compiled regions %s", spec.run, self.figures)

    def _load(self, key: str) -> bool:
        """The artifacts loaded, where the store has them: a store that fails, or artifacts
        another torch cannot read, cost only a compile."""
        try:
            return torch.compiler.load_cache_artifacts(self.store.get_bytes(key)) is not None
        except MissingObject:
            return False
        except Exception:
            logger.exception("compiled artifacts %s not loaded: compiling instead", key)
            return False

    def _save(self, key: str) -> None:
        """What this process compiled, for the next: a store that fails costs them that."""
        try:
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                self.store.put_bytes(key, saved[0], content_type="application/octet-stream")
        except Exception:
            logger.exception("compiled artifacts %s not saved", key)
