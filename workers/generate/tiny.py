"""Builds the `tiny` pipeline defined in models.tiny. Imports torch: GPU-side only."""

import numpy as np
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel
from diffusers import schedulers as diffusers_schedulers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from sdq.models import tiny


def build_pipeline() -> StableDiffusionPipeline:
    vocab = tiny.tokenizer_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
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
    unet = UNet2DConditionModel(**tiny.UNET_CONFIG)
    vae = AutoencoderKL(**tiny.VAE_CONFIG)
    scheduler_class = getattr(diffusers_schedulers, tiny.SCHEDULER_CLASS)
    for offset, module in enumerate((text_encoder, unet, vae)):
        fill_weights(module, seed=tiny.TINY_WEIGHT_SEED + offset)
    pipeline = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler_class.from_config(tiny.SCHEDULER_CONFIG),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return pipeline


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
