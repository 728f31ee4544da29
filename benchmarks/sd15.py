"""A Stable Diffusion 1.5-shaped pipeline with random weights, built in code: the real
model's compute and memory without its weights, for the benchmarks (weights cannot be
downloaded everywhere sdq is measured). tiny's tokenizer: its ids fit CLIP's vocabulary."""

import torch
from clips import VIT_L14_VISION, VIT_L14_WIDTH  # beside this script
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
from transformers import CLIPConfig, CLIPTextConfig, CLIPTextModel

from sdq.models import tiny
from sdq.models.train.architectures import SD15_TEXT_ENCODER, SD15_VAE, UNET_ARCHITECTURES
from sdq.workers.tiny import build_tokenizer

# runwayml/stable-diffusion-v1-5's scheduler config, with Euler as the sampler.
SD15_SCHEDULER = {
    "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000, "prediction_type": "epsilon", "timestep_spacing": "leading",
    "steps_offset": 1,
}  # fmt: skip


def sd15_text_encoder() -> CLIPTextModel:
    vocab = tiny.tokenizer_vocab()
    end = vocab["<|endoftext|>"]
    config = CLIPTextConfig(vocab_size=len(vocab), bos_token_id=vocab["<|startoftext|>"],
                            eos_token_id=end, pad_token_id=end, **SD15_TEXT_ENCODER)  # fmt: skip
    return CLIPTextModel(config)


def sd15_safety_checker() -> StableDiffusionSafetyChecker:
    """SD 1.5's safety checker: CLIP ViT-L/14's vision tower and projection (its text tower
    is not part of it), with the concept embeddings it compares each image to."""
    config = CLIPConfig(vision_config=VIT_L14_VISION, text_config={"hidden_size": 768},
                        projection_dim=VIT_L14_WIDTH)  # fmt: skip
    return StableDiffusionSafetyChecker(config).eval()


def sd15_pipeline(seed: int = 0) -> StableDiffusionPipeline:
    """torch's own initialisation, from `seed`: fast for 1.1 billion parameters."""
    torch.manual_seed(seed)
    return StableDiffusionPipeline(
        vae=AutoencoderKL(**SD15_VAE),
        text_encoder=sd15_text_encoder().eval(),
        tokenizer=build_tokenizer(),
        unet=UNet2DConditionModel(**UNET_ARCHITECTURES["sd15"]),
        scheduler=EulerDiscreteScheduler.from_config(SD15_SCHEDULER),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
