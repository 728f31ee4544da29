"""The plain way to score a checkpoint's renders, as an evaluation script does it with
torchmetrics and transformers, importing nothing of sdq: each image through CLIP's image
processor and image tower once, its normalised embedding feeding torchmetrics'
FrechetInceptionDistance and KernelInceptionDistance (with the tower's embeddings as their
features), and the CLIP score as torchmetrics' CLIPScore defines it (100 x the cosine of
the image's and its prompt's embeddings, 0 at worst; written out: torchmetrics 1.9's own
class fails on transformers 5, whose get_image_features returns an output object).

What benchmarks/evaluate.py measures sdq's evaluate worker against.
"""

from pathlib import Path

import numpy as np
import torch
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.image.kid import KernelInceptionDistance
from transformers import CLIPImageProcessorPil, CLIPModel, CLIPTokenizer


class Given(torch.nn.Module):
    """Features handed to torchmetrics as they are: the CLIP embeddings computed once."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.num_features = width

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features


class PlainScorer:
    def __init__(self, clip: Path, device: str, dtype: torch.dtype, batch_size: int) -> None:
        self.model = CLIPModel.from_pretrained(clip, dtype=dtype).to(device).eval()
        self.processor = CLIPImageProcessorPil.from_pretrained(clip)
        self.tokenizer = CLIPTokenizer.from_pretrained(clip)
        self.device, self.dtype, self.batch_size = device, dtype, batch_size

    @torch.inference_mode()
    def embed(self, images: list, texts: list[str] | None = None) -> tuple[torch.Tensor, list]:
        """Normalised image embeddings (float64, on the CPU) and CLIP scores per image."""
        embeddings, scores = [], []
        for start in range(0, len(images), self.batch_size):
            batch = images[start : start + self.batch_size]
            pixels = self.processor(images=batch, return_tensors="pt")["pixel_values"]
            vision = self.model.vision_model(pixel_values=pixels.to(self.device, self.dtype))
            image = self.model.visual_projection(vision.pooler_output).float()
            image = image / image.norm(dim=-1, keepdim=True)
            if texts is not None:
                tokens = self.tokenizer(texts[start : start + self.batch_size],
                                        padding="max_length", max_length=77, truncation=True,
                                        return_tensors="pt").to(self.device)  # fmt: skip
                text = self.model.text_model(**tokens).pooler_output
                text = self.model.text_projection(text).float()
                text = text / text.norm(dim=-1, keepdim=True)
                scores += (100 * (image * text).sum(dim=-1)).clamp(min=0).tolist()
            embeddings.append(image.double().cpu())
        return torch.cat(embeddings), scores

    def score(self, renders: list, prompts: list[str], real: list) -> dict[str, float]:
        fake_features, clip_scores = self.embed(renders, prompts)
        real_features, _ = self.embed(real)
        width = fake_features.shape[1]
        fid = FrechetInceptionDistance(feature=Given(width))
        kid = KernelInceptionDistance(feature=Given(width), subsets=1,
                                      subset_size=min(len(renders), len(real)))  # fmt: skip
        for metric in (fid, kid):
            metric.update(real_features, real=True)
            metric.update(fake_features, real=False)
        return {
            "clip_score": float(np.mean(clip_scores)),
            "fd_clip": float(fid.compute()),
            "kid": float(kid.compute()[0]),
        }
