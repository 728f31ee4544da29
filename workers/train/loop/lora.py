"""LoRA training (`sdq train --lora-rank R`): peft's adapters on the U-Net's transformer
blocks train, and nothing else does. A checkpoint's state holds the adapters and their
optimizer state (megabytes, where the U-Net's is gigabytes), and its model is one LoRA file
as diffusers' own training scripts save it, which `--lora` and `load_lora_weights` read.
GPU-side: imports torch.
"""

from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY
from diffusers.training_utils import cast_training_params
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sdq.models.train.specs import LORA_FILE, TrainOptions

# The modules each --lora-targets adapts, by the end of their names (as peft matches them),
# in every transformer block: attention's projections, then the feed-forward's two layers.
TARGET_MODULES = {
    "attention": ("to_q", "to_k", "to_v", "to_out.0"),
    "attention+ff": ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"),
}


def training_passes(lora: bool) -> float:
    """A training step's FLOPs in forward passes (the model-FLOPs convention): the forward,
    and a backward that computes the activations' gradients and the weights'; a LoRA's
    frozen weights take none (its adapters' are a rounding error beside them)."""
    return 2.0 if lora else 3.0


def lora_config(rank: int, targets: str, alpha: float | None = None) -> LoraConfig:
    """The adapter a run trains: gaussian-initialised down weights and zero up weights (the
    model starts as its base), scaled by alpha (the rank when None) over the rank."""
    return LoraConfig(
        r=rank,
        lora_alpha=alpha or rank,
        init_lora_weights="gaussian",
        target_modules=list(TARGET_MODULES[targets]),
    )


def run_lora_config(options: TrainOptions) -> LoraConfig:
    return lora_config(options.lora_rank, options.lora_targets, options.lora_alpha)


def add_lora(
    unet: UNet2DConditionModel, options: TrainOptions, frozen_dtype: torch.dtype | None
) -> None:
    """Freezes the U-Net and adds the run's adapter to it, its weights drawn from the run's
    seed (peft draws them on the host, then moves them to the layer's device): the same
    adapter on every rank and machine. Under autocast the frozen weights are kept in its
    precision, as diffusers' LoRA script keeps them (half their memory, and no copy made
    of each in every forward pass); the adapters train in fp32."""
    unet.requires_grad_(False)
    if frozen_dtype is not None:
        unet.to(frozen_dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        unet.add_adapter(run_lora_config(options))
    cast_training_params(unet, dtype=torch.float32)


def adapter_weights(unet: UNet2DConditionModel) -> dict[str, torch.Tensor]:
    """The adapter's weights, named as peft saves them (without the adapter's name), in the
    order of the U-Net's trainable parameters."""
    return get_peft_model_state_dict(unet)


def load_adapter(unet: UNet2DConditionModel, weights: dict[str, torch.Tensor]) -> None:
    """A checkpoint's adapter weights into the U-Net's adapter, every one of them."""
    loaded = set_peft_model_state_dict(unet, weights)
    missing = [name for name in loaded.missing_keys if "lora_" in name]
    if loaded.unexpected_keys or missing:
        raise ValueError(
            f"the checkpoint's adapter does not fit the run's: unexpected "
            f"{loaded.unexpected_keys[:3]}, missing {missing[:3]}"
        )


def save_lora_file(weights: dict[str, torch.Tensor], options: TrainOptions, folder: Path) -> Path:
    """The adapter as a LoRA file in diffusers' format, its rank and alpha in the file's
    metadata (so that an alpha other than the rank is read back as it trained)."""
    from diffusers import StableDiffusionPipeline  # here: the planner builds adapters only

    StableDiffusionPipeline.save_lora_weights(
        folder,
        unet_lora_layers=convert_state_dict_to_diffusers(weights),
        unet_lora_adapter_metadata=_metadata(options),
        weight_name=LORA_FILE,
    )
    _with_one_metadata_key(folder / LORA_FILE)
    return folder / LORA_FILE


def _with_one_metadata_key(path: Path) -> None:
    """The file written again with diffusers' adapter metadata alone, without its "format"
    key: safetensors writes metadata from a hash map, so two keys come out in either order,
    and the same LoRA would be other bytes (its revision is their hash) from run to run."""
    with safe_open(path, "pt") as opened:
        adapter = opened.metadata()[LORA_ADAPTER_METADATA_KEY]
    save_file(load_file(path), path, metadata={LORA_ADAPTER_METADATA_KEY: adapter})


def _metadata(options: TrainOptions) -> dict:
    """The adapter's config as the file records it, the same bytes for the same options:
    peft keeps the target modules as a set, whose order changes from process to process."""
    config = run_lora_config(options).to_dict()
    return {**config, "target_modules": sorted(config["target_modules"])}
