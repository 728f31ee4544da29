"""A rank's U-Net compiled (`--compile`) by region, and what compiling made shared through
the object store. GPU-side: imports torch.

Compiled by region: each repeated block (diffusers' `compile_repeated_blocks`, the U-Net's
transformer blocks) is one graph, compiled once and reused by every block of its shapes,
where a whole-model graph compiles everything at once, anew for each process.

Shared: after a process's first step of each shape, where it compiled anything, rank 0
saves the artifacts to the store (workers/compiled.py) under a key of everything that
decides them (the U-Net's architecture, the step's shapes and dtypes, the precision,
checkpointing, sharding), and every later process loads them before its first step. A run
on aspect-ratio buckets steps in several shapes through graphs of dynamic sizes: its key
holds all of its buckets, so a process that meets them in another order (a job resumed
mid-run) finds what the first made. Within a process a run's jobs reuse the graphs: nothing
compiles again."""

import logging
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from diffusers import UNet2DConditionModel

from sdq.models.store import ObjectStore
from sdq.models.train.specs import TrainShardSpec
from sdq.workers.compiled import artifacts_key, model_architecture, shared_through

logger = logging.getLogger(__name__)


def compile_regions(unet: UNet2DConditionModel, *, buckets: bool) -> None:
    """Each repeated block compiled in place, on its first call (fullgraph: a block that
    would break into pieces fails at once instead of running slowly). On `buckets`, with
    dynamic sizes from the start: one graph for every bucket's shape, whatever order they
    come in, where static ones would compile again as the sizes change (and which graphs a
    process made would depend on the order it met the buckets in)."""
    unet.compile_repeated_blocks(fullgraph=True, dynamic=True if buckets else None)


def step_shapes(inputs, buckets: Sequence[str]) -> dict[str, Any]:
    """The shapes that decide a state's graphs: its step's, or on `buckets`, all of them."""
    if buckets:
        return {"buckets": sorted(buckets), "micro_batch": inputs.latents.shape[0],
                "embeddings": list(inputs.embeddings.shape)}  # fmt: skip
    return {"latents": list(inputs.latents.shape), "embeddings": list(inputs.embeddings.shape)}


def train_key(spec: TrainShardSpec, unet: UNet2DConditionModel, shapes: dict) -> str:
    options = spec.options
    decided_by = {
        "architecture": model_architecture(unet),
        "shapes": shapes,
        "precision": options.mixed_precision,
        "gradient_checkpointing": options.gradient_checkpointing,
        "sharding": options.sharding if options.sharded else None,
    }
    if options.lora:  # its layers are other modules, compiled apart from a whole U-Net's
        decided_by["lora"] = [options.lora_rank, options.lora_alpha, options.lora_targets]
    return artifacts_key("train", decided_by, next(unet.parameters()).device)


@dataclass
class SharedCompile:
    """A compiled state's artifacts, loaded from the store before its first step and saved
    there after its first step of each shape where that compiled anything."""

    store: ObjectStore
    # The (latents, embeddings) shapes stepped in this process: each compiled, or found.
    stepped: set[tuple[tuple[int, ...], ...]] = field(default_factory=set)

    @contextmanager
    def first_of_shape(
        self,
        spec: TrainShardSpec,
        unet: UNet2DConditionModel,
        inputs,
        *,
        buckets: Sequence[str] = (),
        saves: bool,
        took: Callable[[float, bool], None],
    ):
        """Around a step; where it is the state's first of its shape, `took` is told its
        seconds, and whether it was the state's first step (the run's start)."""
        shape = (tuple(inputs.latents.shape), tuple(inputs.embeddings.shape))
        if shape in self.stepped:
            yield
            return
        starting = not self.stepped
        key = train_key(spec, unet, step_shapes(inputs, buckets))
        started = perf_counter()
        with shared_through(self.store, key, loads=starting, saves=saves) as figures:
            yield
        self.stepped.add(shape)
        # Loading, compiling and saving: all of it set aside from the training's speed.
        figures["seconds"] = round(perf_counter() - started, 3)
        took(figures["seconds"], starting)
        # What it compiled and found made, in the log (the tests read it there).
        logger.info("run %s: compiled regions %s", spec.run, figures)
