"""A spec's LoRAs applied to a pipeline, two ways. GPU-side: imports torch.

Fused: each LoRA loaded at its scale and fused into the weights (diffusers'
load_lora_weights, set_adapters, fuse_lora), its layers then let go: the pipeline with
them is one of its own, as fast as the base. That is how an uncompiled worker keeps them.

Swapped: a compiled pipeline keeps one adapter of a fixed rank on the linear layers of the
U-Net's transformer blocks, all zeros until a spec asks for LoRAs (the base model exactly);
a spec's LoRAs, at their scales, are made one adapter of that rank and swapped into it in
place (diffusers' LoRA hot-swap, peft's hotswap_adapter): neither the base is loaded again
nor anything compiled again, whatever LoRA set a call brings. A LoRA set that does not fit
the adapter (its text encoder's weights, layers the adapter lacks, ranks above it) is fused
instead.
"""

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import convert_unet_state_dict_to_peft

from sdq.models.generate.specs import GenerationSpec
from sdq.workers.weights import PipelineError

ADAPTER = "sdq"
# The U-Net's layers the swapped adapter covers, where they are linear: those of its
# transformer blocks, where LoRA trainers (diffusers' scripts, kohya's) put theirs (SD 1.5's
# proj_in and proj_out are 1x1 convolutions: a LoRA of them is fused).
SWAPPED_LAYERS = ("to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out",
                  "ff.net.0.proj", "ff.net.2")  # fmt: skip


class NotSwappable(Exception):
    """A LoRA set the swapped adapter cannot hold: fused into a pipeline of its own."""


def fuse_loras(pipeline: DiffusionPipeline, spec: GenerationSpec, files: list[Path]) -> None:
    """Fuses the spec's LoRAs into the pipeline's weights at their scales, then lets their
    layers go. Before compiling and fusing Q, K and V, whose module names the LoRAs' keys
    are written against."""
    names = [f"lora_{index}" for index in range(len(files))]
    for name, path, lora in zip(names, files, spec.loras, strict=True):
        try:
            pipeline.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        except torch.OutOfMemoryError:
            raise
        except (ValueError, KeyError, RuntimeError) as error:
            raise PipelineError(
                f"LoRA {lora['name']} cannot apply to model {spec.model_name}: {error}"
            ) from error
    applied = {name for adapters in pipeline.get_list_adapters().values() for name in adapters}
    for name, lora in zip(names, spec.loras, strict=True):
        if name not in applied:  # diffusers only warns of a LoRA that matches no module
            raise PipelineError(
                f"LoRA {lora['name']} has no weights for model {spec.model_name}'s modules"
            )
    pipeline.set_adapters(names, adapter_weights=[float(lora["scale"]) for lora in spec.loras])
    pipeline.fuse_lora(adapter_names=names, lora_scale=1.0)
    pipeline.unload_lora_weights()


def make_swappable(pipeline: DiffusionPipeline, rank: int) -> None:
    """Before compiling: the adapter LoRAs are swapped into, of `rank`, all zeros. Its
    scalings are tensors (enable_lora_hotswap), so a swap changes no guarded value."""
    pipeline.enable_lora_hotswap(target_rank=rank)
    zeros = {}
    for name, layer in pipeline.unet.named_modules():
        if isinstance(layer, torch.nn.Linear) and name.endswith(SWAPPED_LAYERS):
            zeros[f"unet.{name}.lora_A.weight"] = layer.weight.new_zeros(rank, layer.in_features)
            zeros[f"unet.{name}.lora_B.weight"] = layer.weight.new_zeros(layer.out_features, rank)
    pipeline.load_lora_weights(zeros, adapter_name=ADAPTER)


def swap_in(pipeline: DiffusionPipeline, spec: GenerationSpec, files: list[Path],
            rank: int) -> None:  # fmt: skip
    """The spec's LoRAs swapped into the pipeline's adapter (make_swappable)."""
    adapter = swapped_adapter(pipeline, spec, files, rank)
    pipeline.load_lora_weights(adapter, adapter_name=ADAPTER, hotswap=True)


def swapped_adapter(
    pipeline: DiffusionPipeline, spec: GenerationSpec, files: list[Path], rank: int
) -> dict[str, torch.Tensor]:
    """The spec's LoRAs as one adapter of `rank` at scaling 1: per layer, the LoRAs' down
    weights stacked and their up weights side by side, each up weight times its LoRA's
    scale and its own alpha over its rank, so the adapter adds the sum of what each LoRA
    adds; zeros for the rest of the rank. The layers no LoRA touches peft's swap zeroes
    (so a set of fewer layers follows one of more)."""
    downs: dict[str, list[torch.Tensor]] = {}
    ups: dict[str, list[torch.Tensor]] = {}
    for path, lora in zip(files, spec.loras, strict=True):
        try:
            layers = _lora_layers(pipeline, path, float(lora["scale"]))
        except (ValueError, KeyError, OSError) as error:
            raise PipelineError(f"LoRA {lora['name']} cannot be read: {error}") from error
        for layer, (down, up) in layers.items():
            downs.setdefault(layer, []).append(down)
            ups.setdefault(layer, []).append(up)
    adapter = {}
    for layer, stacked in downs.items():
        _check_fits(pipeline, layer, stacked + ups[layer], spec)
        down, up = torch.cat(stacked), torch.cat(ups[layer], dim=1)
        if down.shape[0] > rank:
            raise NotSwappable(f"its ranks add up to {down.shape[0]} at {layer}, above {rank}")
        adapter[f"{layer}.lora_A.weight"] = _padded(down, rank, dim=0)
        adapter[f"{layer}.lora_B.weight"] = _padded(up, rank, dim=1)
    return adapter


def _lora_layers(
    pipeline: DiffusionPipeline, path: Path, scale: float
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A LoRA file's layers as diffusers reads it (any trainer's format): layer -> (down,
    up times scale x alpha / rank)."""
    weights, alphas, metadata = pipeline.lora_state_dict(
        str(path.parent), weight_name=path.name, return_lora_metadata=True,
        unet_config=pipeline.unet.config,  # SDXL's kohya block names mapped to diffusers'
    )  # fmt: skip
    weights = convert_unet_state_dict_to_peft(weights)
    layers = {key.rsplit(".lora_", 1)[0] for key in weights}
    if any(not layer.startswith("unet.") for layer in layers):
        raise NotSwappable("it has text encoder weights")
    if len(weights) != 2 * len(layers) or not all(
        f"{layer}.lora_{side}.weight" in weights for layer in layers for side in "AB"
    ):
        raise NotSwappable("its layers are not each one down and one up weight")
    alpha_of = _alphas(alphas, metadata)
    found = {}
    for layer in layers:
        down, up = weights[f"{layer}.lora_A.weight"], weights[f"{layer}.lora_B.weight"]
        alpha = alpha_of(layer, down.shape[0])
        found[layer] = (down.float(), up.float() * (scale * alpha / down.shape[0]))
    return found


def _check_fits(
    pipeline: DiffusionPipeline, layer: str, weights: list[torch.Tensor], spec: GenerationSpec
) -> None:
    """A layer the adapter has (else the set is fused), with the LoRAs' sizes its own (else
    they are another model's: a LoRA that cannot apply, as fusing it would say)."""
    try:
        module = pipeline.unet.get_submodule(layer.removeprefix("unet."))
        down, up = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
    except (AttributeError, KeyError, TypeError):
        raise NotSwappable(f"the adapter has no layer {layer}") from None
    count = len(weights) // 2
    if any(w.shape[1] != down.shape[1] for w in weights[:count]) or any(
        w.shape[0] != up.shape[0] for w in weights[count:]
    ):
        names = ", ".join(lora["name"] for lora in spec.loras)
        raise PipelineError(
            f"LoRA {names} cannot apply to model {spec.model_name}: {layer} is "
            f"{down.shape[1]} to {up.shape[0]} wide there"
        )


def _alphas(alphas: dict[str, float] | None, metadata: dict[str, Any] | None):
    """Each layer's alpha as diffusers takes it: the file's alphas (the most common for a
    layer without one), its adapter config's lora_alpha, or else the layer's rank."""
    if metadata:
        if (
            metadata.get("unet.alpha_pattern")
            or metadata.get("unet.rank_pattern")
            or any(metadata.get(f"unet.{option}") for option in ("use_dora", "use_rslora"))
        ):
            raise NotSwappable("its adapter config has per-layer patterns or variants")
        alpha = metadata.get("unet.lora_alpha")
        return lambda layer, rank: alpha if alpha is not None else rank
    if alphas:
        common = Counter(alphas.values()).most_common(1)[0][0]
        return lambda layer, rank: alphas.get(f"{layer}.alpha", common)
    return lambda layer, rank: rank


def _padded(weight: torch.Tensor, rank: int, *, dim: int) -> torch.Tensor:
    missing = rank - weight.shape[dim]
    if not missing:
        return weight
    shape = list(weight.shape)
    shape[dim] = missing
    return torch.cat([weight, weight.new_zeros(shape)], dim=dim)
