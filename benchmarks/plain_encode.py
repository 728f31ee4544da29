"""The plain way to encode images for training, as a script does it: a VAE and a text
encoder, each batch's JPEGs decoded and scaled to [-1, 1], a sample of each latent
distribution (a generator per sample, from the seeds given), the captions through the text
encoder, the results written to local parquet. No queue, no database, and nothing of
sdq's: what sdq's encoding is measured against by benchmarks/encode.py and
benchmarks/device_check.py."""

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from diffusers import AutoencoderKL
from PIL import Image
from transformers import CLIPTextModel, CLIPTokenizer


class PlainEncoder:
    def __init__(self, vae, text_encoder, tokenizer, device="cpu", dtype=torch.float32) -> None:
        self.vae = vae.to(device, dtype).eval()
        self.text_encoder = text_encoder.to(device, dtype).eval()
        self.tokenizer, self.device, self.dtype = tokenizer, torch.device(device), dtype

    @classmethod
    def from_pretrained(cls, folder: Path, device="cpu", dtype=torch.float32) -> "PlainEncoder":
        """The VAE, text encoder and tokenizer of a diffusers pipeline's folder."""
        return cls(
            AutoencoderKL.from_pretrained(folder, subfolder="vae", dtype=dtype),
            CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", dtype=dtype),
            CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer"),
            device,
            dtype,
        )

    @torch.inference_mode()
    def encode(
        self, images: list[bytes], captions: list[str], seeds: list[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """One batch: its latents (scaled) and its captions' embeddings."""
        pixels = np.stack(
            [np.asarray(Image.open(io.BytesIO(data)).convert("RGB")) for data in images]
        )
        batch = torch.from_numpy(pixels).to(self.device).permute(0, 3, 1, 2).float() / 127.5 - 1
        distribution = self.vae.encode(batch.to(self.dtype)).latent_dist
        generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        latents = distribution.sample(generator=generators) * self.vae.config.scaling_factor
        tokens = self.tokenizer(
            captions, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
        ).input_ids
        embeddings = self.text_encoder(tokens.to(self.device))[0]
        return latents.cpu().numpy(), embeddings.cpu().numpy()


def save(path: Path, keys, latents: np.ndarray, embeddings: np.ndarray) -> None:
    """A shard's keys, latents and embeddings as one parquet file."""
    columns = {"key": keys}
    for name, array in (("latents", latents), ("text_embeddings", embeddings)):
        flat = pa.array(array.reshape(-1))
        columns[name] = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(array.shape[1:])))
    pq.write_table(pa.table(columns), path)
