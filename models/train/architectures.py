"""U-Net architectures a run can train from random weights (`sdq train --from-scratch
--unet-config NAME|FILE`): Stable Diffusion's own, as diffusers configures them, or any
diffusers U-Net config file."""

import json
from pathlib import Path
from typing import Any

_SD_BLOCKS: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "sample_size": 64,
    "layers_per_block": 2,
    "block_out_channels": [320, 640, 1280, 1280],
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "act_fn": "silu",
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
}
UNET_ARCHITECTURES: dict[str, dict[str, Any]] = {
    # runwayml/stable-diffusion-v1-5: CLIP ViT-L/14 text (768 wide), 8 heads everywhere.
    "sd15": {**_SD_BLOCKS, "cross_attention_dim": 768, "attention_head_dim": 8},
    # stabilityai/stable-diffusion-2-base: OpenCLIP ViT-H/14 text (1024 wide), 64-wide
    # heads (diffusers calls their count attention_head_dim), linear projections.
    "sd2-base": {
        **_SD_BLOCKS,
        "cross_attention_dim": 1024,
        "attention_head_dim": [5, 10, 20, 20],
        "use_linear_projection": True,
    },
    # stabilityai/stable-diffusion-xl-base-1.0: three levels, transformers 1, 2 and 10 deep,
    # attending to both text encoders' hidden states (768 + 1280 wide); the pooled
    # embedding (1280) and six time ids (256 wide each) added to the timestep's embedding.
    "sdxl": {
        **_SD_BLOCKS,
        "sample_size": 128,
        "block_out_channels": [320, 640, 1280],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "transformer_layers_per_block": [1, 2, 10],
        "attention_head_dim": [5, 10, 20],
        "cross_attention_dim": 2048,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
    },
}
# SDXL's micro-conditioning: original height and width, crop top and left, target height
# and width, each embedded addition_time_embed_dim wide.
TIME_IDS = 6


# The rest of Stable Diffusion 1.5's shape, for the benchmarks' random-weight pipelines:
# CLIP ViT-L/14's text tower and SD's VAE (4 latent channels, 8x down).
SD15_TEXT_ENCODER: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
    "projection_dim": 768,
}  # fmt: skip
SD15_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "sample_size": 512,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "norm_num_groups": 32, "act_fn": "silu", "scaling_factor": 0.18215,
}  # fmt: skip


class InvalidArchitecture(Exception):
    pass


def unet_architecture(name_or_file: str) -> dict[str, Any]:
    """A named architecture, or a diffusers U-Net config file (config.json)."""
    if name_or_file in UNET_ARCHITECTURES:
        return dict(UNET_ARCHITECTURES[name_or_file])
    path = Path(name_or_file)
    if not path.is_file():
        raise InvalidArchitecture(
            f"--unet-config {name_or_file!r}: neither {' nor '.join(UNET_ARCHITECTURES)} "
            "nor a U-Net config file"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidArchitecture(f"{path}: not a JSON U-Net config ({error})") from None
    if not isinstance(config, dict) or "block_out_channels" not in config:
        raise InvalidArchitecture(f"{path}: not a U-Net config (no block_out_channels)")
    return {key: value for key, value in config.items() if not key.startswith("_")}


def pooled_width(config: dict[str, Any]) -> int | None:
    """The pooled text embedding's width an SDXL U-Net (text_time conditioning) adds to its
    timestep's embedding; None for a U-Net without it."""
    if config.get("addition_embed_type") != "text_time":
        return None
    widths = ("addition_time_embed_dim", "projection_class_embeddings_input_dim")
    missing = [name for name in widths if not isinstance(config.get(name), int)]
    if missing:
        raise InvalidArchitecture(f"a text_time U-Net config needs {' and '.join(missing)}")
    times = TIME_IDS * config["addition_time_embed_dim"]
    return config["projection_class_embeddings_input_dim"] - times


def check_fits(
    config: dict[str, Any], *, latent_channels: int, text_width: int, pooled: int | None
) -> None:
    """The architecture takes the dataset's latents and text embeddings as they are, and
    the pooled embeddings of an SDXL model's encode where it is SDXL's (and only there)."""
    channels = config.get("in_channels", 4)
    width = config.get("cross_attention_dim", 1280)
    if channels != latent_channels or width != text_width:
        raise InvalidArchitecture(
            f"the U-Net takes {channels}-channel latents and {width}-wide text embeddings; "
            f"the dataset's latents have {latent_channels} channels and its text embeddings "
            f"are {text_width} wide"
        )
    takes = pooled_width(config)
    if takes == pooled:
        return
    if takes is None:
        why = (
            "the U-Net has no text_time conditioning (SDXL's) for the pooled text "
            "embeddings of the dataset's SDXL encode: train an SDXL U-Net "
            "(--unet-config sdxl, or a file), or encode with the model you train"
        )
    elif pooled is None:
        why = (
            "the U-Net is SDXL's (text_time conditioning) and needs pooled text "
            "embeddings, which the dataset's encode did not make: encode it with an "
            "SDXL model"
        )
    else:
        why = f"the U-Net takes {takes}-wide pooled text embeddings; the dataset's are {pooled}"
    raise InvalidArchitecture(why)
