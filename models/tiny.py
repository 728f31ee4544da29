"""The `tiny` model: a small random-weight Stable Diffusion pipeline defined here, in full.

Its weights are drawn from a fixed NumPy seed, so every machine builds the same pipeline
and its identity is a hash of this definition: computable without torch, on the producer
side. It draws noise, not pictures; it exists for tests, benchmarks and offline demos.
"""

import itertools
from functools import cache
from typing import Any

from sdq.models.specs import canonical_sha256

TINY_NAME = "tiny"
TINY_WEIGHT_SEED = 20261122
# Bump when the way weights are drawn changes: it is part of the identity.
TINY_GENERATOR_VERSION = 1

SCHEDULER_CLASS = "EulerDiscreteScheduler"
SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "timestep_spacing": "leading",
    "steps_offset": 1,
}
UNET_CONFIG: dict[str, Any] = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [16, 32],
    "layers_per_block": 1,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
    "cross_attention_dim": 32,
    "attention_head_dim": 4,
    "norm_num_groups": 4,
}
# Four blocks give the VAE the same 8x downsampling as Stable Diffusion's.
VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [8, 8, 16, 16],
    "latent_channels": 4,
    "norm_num_groups": 4,
    "sample_size": 64,
}
TEXT_ENCODER_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "max_position_embeddings": 77,
    "layer_norm_eps": 1e-5,
    "projection_dim": 32,
}
# The `tiny` CLIP (curate's and evaluate's `--model tiny`): a CLIPModel of random weights on
# the same character-level tokenizer, so that the whole chain runs without a download.
CLIP_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 77,
}
CLIP_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}
CLIP_PROJECTION_DIM = 16


def byte_level_alphabet() -> list[str]:
    """The 256 printable characters CLIP's byte-level BPE maps bytes to (GPT-2's table)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    shifted, extra = [], 0
    for byte in range(256):
        if byte in printable:
            shifted.append(byte)
        else:
            shifted.append(256 + extra)
            extra += 1
    return [chr(code) for code in shifted]


@cache
def tokenizer_vocab() -> dict[str, int]:
    """A character-level CLIP vocabulary: every byte, alone or ending a word, plus specials."""
    alphabet = byte_level_alphabet()
    tokens = alphabet + [f"{char}</w>" for char in alphabet]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}


def definition() -> dict[str, Any]:
    return {
        "name": TINY_NAME,
        "generator_version": TINY_GENERATOR_VERSION,
        "weight_seed": TINY_WEIGHT_SEED,
        "unet": UNET_CONFIG,
        "vae": VAE_CONFIG,
        "text_encoder": TEXT_ENCODER_CONFIG,
        "vocab_size": len(tokenizer_vocab()),
        "scheduler": [SCHEDULER_CLASS, SCHEDULER_CONFIG],
    }


@cache
def content_hash() -> str:
    return canonical_sha256(definition())


@cache
def clip_revision() -> str:
    """The tiny CLIP's identity: a hash of its definition, as the pipeline's."""
    return canonical_sha256({
        "name": f"{TINY_NAME}-clip",
        "generator_version": TINY_GENERATOR_VERSION,
        "weight_seed": TINY_WEIGHT_SEED,
        "text": CLIP_TEXT_CONFIG,
        "vision": CLIP_VISION_CONFIG,
        "projection_dim": CLIP_PROJECTION_DIM,
        "vocab_size": len(tokenizer_vocab()),
    })  # fmt: skip


@cache
def encoders_hash() -> str:
    """What makes the tiny model's latents: its definition but the U-Net and scheduler."""
    encoders = {k: v for k, v in definition().items() if k not in ("unet", "scheduler")}
    return canonical_sha256(encoders)


def head_file(widths: list[int], stream: int) -> bytes:
    """A scoring head of linear layers of these widths (`layers.<i>.weight` and `.bias`, as
    curate reads a head), random from the tiny seed and `stream`, as safetensors: what
    `--aesthetic-head tiny` and `--nsfw-head tiny` score with. The same bytes everywhere."""
    import numpy as np
    from safetensors.numpy import save

    draw = np.random.default_rng([TINY_WEIGHT_SEED, TINY_GENERATOR_VERSION, stream])
    tensors = {}
    for index, (inputs, outputs) in enumerate(itertools.pairwise(widths)):
        bound = inputs**-0.5  # torch's Linear's own initial range
        tensors[f"layers.{index}.weight"] = draw.uniform(-bound, bound, (outputs, inputs))
        tensors[f"layers.{index}.bias"] = draw.uniform(-bound, bound, outputs)
    return save({name: value.astype(np.float32) for name, value in tensors.items()})
