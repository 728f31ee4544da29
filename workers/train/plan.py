"""What a training configuration needs of each GPU, before anything runs: the U-Net is built
on the meta device (shapes, no memory, no weights: the SD 2 U-Net in ~0.1 s) and one
forward pass at the micro-batch is traced there, its saved-for-backward tensors summed and
its FLOPs counted. GPU-side: imports torch.

Per GPU, in bytes: parameters (fp32), gradients (fp32, DDP's buckets are the gradients),
AdamW's two moments (fp32), the EMA weights (fp32, held by rank 0), each of them 1/N of the
whole on each of N ranks where `--sharding` spreads it (plus what a step gathers whole:
every weight through a step under grad-op, the two largest blocks' under full, and one
block's unsharded gradients before they are reduce-scattered), and the activations
kept for the backward pass, at the autocast precision, with or without gradient
checkpointing (plus, under autocast, the half-precision copies of the weights it keeps for
the backward pass). Under a LoRA (`--lora-rank`) the U-Net's weights are frozen, kept in
the autocast precision, and the gradients, optimizer state and EMA are its adapters'.
Attention is counted as a GPU runs it, flash or memory-efficient SDPA, which keeps the
output and the log-sum-exp, never the attention matrix. What the
plan leaves out (the CUDA context, kernels' workspaces, the allocator's fragmentation) is
why a configuration fits only within USABLE of the GPU's memory.

    python -m sdq.workers.train.plan '{"unet_config": {...}, "resolution": 256, ...}'
prints the plan as JSON: the CLI (`sdq train plan`) runs it so, and never loads torch.
"""

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from torch.utils.flop_counter import FlopCounterMode

from sdq.models.datasets.buckets import buckets_for
from sdq.models.train.architectures import TIME_IDS, pooled_width
from sdq.workers.shards.latents import POOLED_CONDITION, TIME_IDS_CONDITION
from sdq.workers.train.loop.lora import lora_config, training_passes
from sdq.workers.train.loop.sharding import shard_units

# The share of a GPU's memory a plan may fill.
USABLE = 0.9
TEXT_TOKENS = 77
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16, "auto": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    unet_config: dict[str, Any]
    resolution: int
    batch_size: int  # the global batch, as `sdq train --batch-size` takes it
    world_size: int = 1
    sharding: str = "none"
    grad_accumulation: int = 1
    mixed_precision: str = "auto"  # as on a GPU: auto is bf16
    gradient_checkpointing: bool = False
    ema: bool = True
    # A LoRA of this rank trains on the frozen U-Net (None: the whole U-Net trains).
    lora_rank: int | None = None
    lora_targets: str = "attention"
    # On aspect-ratio buckets of the resolution's area: planned for the one of most pixels.
    buckets: bool = False
    gpu_memory: int = 80 * 10**9

    @property
    def micro_batch(self) -> int:
        return max(1, self.batch_size // (self.world_size * self.grad_accumulation))

    @property
    def latent_size(self) -> tuple[int, int]:
        """The latents' height and width: the square's, or the largest bucket's."""
        if not self.buckets:
            return self.resolution // 8, self.resolution // 8
        largest = max(buckets_for(self.resolution), key=lambda b: (b.width * b.height, b))
        return largest.height // 8, largest.width // 8


@dataclass(frozen=True)
class Plan:
    per_gpu_bytes: int
    parts: dict[str, int]
    flops_per_sample: float
    fits: bool
    micro_batch: int
    gpu_memory: int
    usable_bytes: int
    # When it does not fit: the first change of options that would make it, else None.
    would_fit_with: str | None = None


def plan(request: PlanRequest) -> Plan:
    """The plan of a configuration, and when it does not fit, what would make it."""
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(request.unet_config)
    if request.lora_rank is not None:
        unet.requires_grad_(False)
        unet.add_adapter(lora_config(request.lora_rank, request.lora_targets))
    found = _plan(unet, request)
    if found.fits:
        return found
    for change, changed in _remedies(request):
        if _plan(unet, changed).fits:
            return replace(found, would_fit_with=change)
    return found


def _plan(unet: UNet2DConditionModel, request: PlanRequest) -> Plan:
    parameters = sum(parameter.numel() for parameter in unet.parameters())
    activations, flops = _traced(unet, request)
    half = HALF.get(request.mixed_precision)
    # A LoRA's frozen weights are kept in the autocast precision; autocast copies the rest.
    frozen = parameters - _trained(unet) if half is not None and request.lora_rank else 0
    if half is not None:
        activations += (parameters - frozen) * half.itemsize  # autocast's copies
    parts = {**_state_parts(unet, parameters, request), "activations": activations}
    if frozen:
        parts["parameters"] -= frozen * (4 - half.itemsize)
    total = sum(parts.values())
    usable = int(request.gpu_memory * USABLE)
    return Plan(total, parts, flops, total <= usable, request.micro_batch, request.gpu_memory,
                usable)  # fmt: skip


def _state_parts(
    unet: UNet2DConditionModel, parameters: int, request: PlanRequest
) -> dict[str, int]:
    """Bytes of the training state on one GPU, in fp32: each part 1/N of the whole when
    sharded over N ranks, plus what a step holds gathered. Under a LoRA, the gradients,
    optimizer state and EMA are the adapters' alone."""
    if request.sharding == "none" or request.world_size == 1:
        trained = _trained(unet)
        ema = 4 * trained if request.ema else 0
        return {"parameters": 4 * parameters, "gradients": 4 * trained,
                "optimizer": 8 * trained, "ema": ema}  # fmt: skip
    shard = -(-parameters // request.world_size)
    largest = max(sum(p.numel() for p in unit.parameters()) for unit in shard_units(unet))
    # grad-op keeps every gathered weight from the forward to the backward; full gathers
    # one block while the one before it computes.
    gathered = parameters if request.sharding == "grad-op" else 2 * largest
    return {
        "parameters": 4 * (shard + gathered),
        "gradients": 4 * (shard + largest),
        "optimizer": 8 * shard,
        "ema": 4 * shard if request.ema else 0,
    }


def _trained(unet: UNet2DConditionModel) -> int:
    return sum(parameter.numel() for parameter in unet.parameters() if parameter.requires_grad)


def _remedies(request: PlanRequest) -> Iterator[tuple[str, PlanRequest]]:
    """Changes that cost the least speed first, each on top of the ones before: sharding
    the optimizer state (a reduce-scatter instead of an all-reduce, on more than one
    rank), recomputing activations, sharding the weights too (gathered twice a step), then
    accumulating smaller micro-batches into the same global batch."""
    changes: list[tuple[str, dict[str, Any]]] = []
    spread = request.world_size > 1 and request.lora_rank is None  # a LoRA is never sharded
    if spread and request.sharding == "none":
        changes.append(("--sharding grad-op", {"sharding": "grad-op"}))
    if not request.gradient_checkpointing:
        changes.append(("--gradient-checkpointing", {"gradient_checkpointing": True}))
    if spread and request.sharding != "full":
        changes.append(("--sharding full", {"sharding": "full"}))
    accumulation = request.grad_accumulation * 2
    while request.batch_size % (request.world_size * accumulation) == 0:
        changes.append((f"--grad-accumulation {accumulation}", {"grad_accumulation": accumulation}))
        accumulation *= 2
    flags: dict[str, str] = {}  # by option: a later --sharding replaces an earlier one
    changed = request
    for flag, change in changes:
        changed = replace(changed, **change)
        flags.update(dict.fromkeys(change, flag))
        yield " ".join(flags.values()), changed


def _traced(unet: UNet2DConditionModel, request: PlanRequest) -> tuple[int, float]:
    """The bytes one forward pass keeps for the backward, and the training FLOPs per
    sample (3x the forward's: the usual model-FLOPs convention)."""
    dtype = HALF.get(request.mixed_precision, torch.float32)
    model = unet.to(dtype).train()
    if request.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    else:
        model.disable_gradient_checkpointing()
    batch, (height, width) = request.micro_batch, request.latent_size
    channels = model.config.in_channels
    latents = torch.zeros((batch, channels, height, width), device="meta", dtype=dtype)
    hidden = request.unet_config.get("cross_attention_dim", 768)
    embeddings = torch.zeros((batch, TEXT_TOKENS, hidden), device="meta", dtype=dtype)
    timesteps = torch.zeros((batch,), device="meta", dtype=torch.long)
    pooled = pooled_width(request.unet_config)
    added = None
    if pooled is not None:  # SDXL's pooled embedding and time ids
        added = {
            POOLED_CONDITION: torch.zeros((batch, pooled), device="meta", dtype=dtype),
            TIME_IDS_CONDITION: torch.zeros((batch, TIME_IDS), device="meta", dtype=dtype),
        }
    kept = _KeptForBackward({id(parameter) for parameter in model.parameters()})
    counter = FlopCounterMode(display=False)
    with _attention_as_on_a_gpu(), kept.hooks(), counter:
        model(latents, timesteps, embeddings, added_cond_kwargs=added)
    return kept.bytes, training_passes(
        request.lora_rank is not None
    ) * counter.get_total_flops() / batch


class _KeptForBackward:
    """Sums the tensors autograd saves, each storage once, parameters apart."""

    def __init__(self, parameters: set[int]) -> None:
        self.parameters = parameters
        self._sizes: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) not in self.parameters:
            self._sizes[id(base)] = base.numel() * base.element_size()
        return tensor

    @contextmanager
    def hooks(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())


@contextmanager
def _attention_as_on_a_gpu() -> Iterator[None]:
    """SDPA as a GPU runs it in training (flash attention): on the meta device it would take
    its math path, whose backward keeps the whole attention matrix."""
    plain: Callable = F.scaled_dot_product_attention

    def flash(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              **_):  # fmt: skip
        flash_attention = torch.ops.aten._scaled_dot_product_flash_attention
        return flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]

    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = plain


def main(argument: str) -> None:
    print(json.dumps(asdict(plan(PlanRequest(**json.loads(argument))))))


if __name__ == "__main__":
    main(sys.argv[1])
