"""Builds the `tiny` model defined in models.tiny, whole or by component (encoding needs
only the VAE and text encoder). Imports torch: GPU-side only."""

import numpy as np
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from diffusers import schedulers as diffusers_schedulers
from transformers import (
    CLIPConfig,
    CLIPImageProcessorPil,
    CLIPModel,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
)

from sdq.models import tiny


def build_tokenizer() -> CLIPTokenizer:
    return CLIPTokenizer(vocab=tiny.tokenizer_vocab(), merges=[], model_max_length=77)


def build_text_encoder() -> CLIPTextModel:
    vocab = tiny.tokenizer_vocab()
    end = vocab["<|endoftext|>"]
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(vocab),
            bos_token_id=vocab["<|startoftext|>"],
            eos_token_id=end,
            pad_token_id=end,
            **tiny.TEXT_ENCODER_CONFIG,
        )
    )
    fill_weights(text_encoder, seed=tiny.TINY_WEIGHT_SEED)
    return text_encoder


def build_unet() -> UNet2DConditionModel:
    unet = UNet2DConditionModel(**tiny.UNET_CONFIG)
    fill_weights(unet, seed=tiny.TINY_WEIGHT_SEED + 1)
    return unet


def build_vae() -> AutoencoderKL:
    vae = AutoencoderKL(**tiny.VAE_CONFIG)
    fill_weights(vae, seed=tiny.TINY_WEIGHT_SEED + 2)
    return vae


def build_pipeline() -> StableDiffusionPipeline:
    scheduler_class = getattr(diffusers_schedulers, tiny.SCHEDULER_CLASS)
    return StableDiffusionPipeline(
        vae=build_vae(),
        text_encoder=build_text_encoder(),
        tokenizer=build_tokenizer(),
        unet=build_unet(),
        scheduler=scheduler_class.from_config(tiny.SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_clip() -> tuple[CLIPModel, CLIPTokenizer, CLIPImageProcessorPil]:
    """The tiny CLIP (models/tiny.py): the model, its tokenizer and its image processor."""
    vocab = tiny.tokenizer_vocab()
    end = vocab["<|endoftext|>"]
    text = {**tiny.CLIP_TEXT_CONFIG, "vocab_size": len(vocab), "bos_token_id":
            vocab["<|startoftext|>"], "eos_token_id": end, "pad_token_id": end}  # fmt: skip
    config = CLIPConfig(text_config=text, vision_config=tiny.CLIP_VISION_CONFIG,
                        projection_dim=tiny.CLIP_PROJECTION_DIM)  # fmt: skip
    model = CLIPModel(config)
    fill_weights(model, seed=tiny.TINY_WEIGHT_SEED + 3)
    side = tiny.CLIP_VISION_CONFIG["image_size"]
    processor = CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    return model, build_tokenizer(), processor


def fill_weights(module: torch.nn.Module, *, seed: int) -> None:
    """Overwrites every parameter from a NumPy stream: the same numbers on any torch version."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            if name.endswith("bias"):
                values = np.zeros(parameter.shape)
            elif "norm" in name:
                values = np.ones(parameter.shape)
            else:
                fan_in = max(1, parameter[0].numel()) if parameter.dim() > 1 else parameter.numel()
                values = rng.normal(0.0, fan_in**-0.5, size=parameter.shape)
            parameter.copy_(torch.from_numpy(values.astype(np.float32)))
