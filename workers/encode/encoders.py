"""A model's VAE and text encoder, loaded once per worker process, and batches encoded
with them: images to scaled samples of their latent distributions, captions to CLIP
hidden states. GPU-side: imports torch. The U-Net is never loaded for this."""

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from sdq.models import tiny
from sdq.models.datasets import latent_seed
from sdq.models.encode.specs import EncodeSpec
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.shards.images import ImageShard, pixels
from sdq.workers.shards.latents import Encoded
from sdq.workers.tiny import build_text_encoder, build_tokenizer, build_vae
from sdq.workers.weights import ModelFiles, check_tiny_revision


@dataclass(frozen=True)
class Encoders:
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: CLIPTokenizer
    device: torch.device
    dtype: torch.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        # NumPy and parquet have no bfloat16; float32 holds it exactly.
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype


class LoadedEncoders:
    """The encoders of the last model this process used: a worker encodes one model's
    dataset shard after shard, and a GPU has no room to spare for a second."""

    def __init__(self, files: ModelFiles) -> None:
        self.files = files
        self._key: tuple[str, str, str] | None = None
        self._encoders: Encoders | None = None
        # Objects this process has stored that only depend on the model (the empty prompt).
        self.stored: set[str] = set()

    def clear(self) -> None:
        self._key, self._encoders = None, None
        release_device_memory()

    def get(self, spec: EncodeSpec) -> Encoders:
        key = (spec.model_source, spec.model_revision, torch_dtype(spec.dtype))
        if key != self._key or self._encoders is None:
            self._encoders = None  # let the old weights go before the new ones load
            self._encoders = self._load(spec)
            self._key = key
        return self._encoders

    def _load(self, spec: EncodeSpec) -> Encoders:
        dtype = torch_dtype(spec.dtype)
        if spec.model_source == tiny.TINY_NAME:
            check_tiny_revision(spec.model_revision)
            vae, text_encoder, tokenizer = build_vae(), build_text_encoder(), build_tokenizer()
        else:
            where = self.files.locate(spec.model_source, spec.model_revision)
            found = {"revision": where.revision}
            vae = AutoencoderKL.from_pretrained(where.path, subfolder="vae", dtype=dtype, **found)
            text_encoder = CLIPTextModel.from_pretrained(
                where.path, subfolder="text_encoder", dtype=dtype, **found
            )
            tokenizer = CLIPTokenizer.from_pretrained(where.path, subfolder="tokenizer", **found)
        device = torch.device(device_name())
        vae = vae.to(device, dtype).eval().requires_grad_(False)
        text_encoder = text_encoder.to(device, dtype).eval().requires_grad_(False)
        if device.type == "cuda":
            # Convolutions in channels-last layout run on tensor cores without transposes.
            vae = vae.to(memory_format=torch.channels_last)
        return Encoders(vae, text_encoder, tokenizer, device, dtype)


@dataclass(frozen=True)
class Batch:
    """One batch as the CPU prepared it: pixels as uint8 (a quarter of the bytes of floats
    to copy to the device), token ids, and each sample's latent seed."""

    pixels: torch.Tensor  # batch x height x width x 3, uint8
    token_ids: torch.Tensor  # batch x tokens
    seeds: list[int]


def prepare_batches(
    shard: ImageShard,
    spec: EncodeSpec,
    tokenizer: CLIPTokenizer,
    *,
    batch_size: int,
    decoders: ThreadPoolExecutor,
    pin: bool,
) -> Iterator[Batch]:
    """The CPU work of encoding, batch by batch: decoding and cropping (on `decoders`,
    since Pillow decodes without the GIL), tokenizing and pinning for a fast copy."""
    for start in range(0, len(shard), batch_size):
        stop = start + batch_size
        images = decoders.map(lambda data: pixels(data, spec.resolution), shard.images[start:stop])
        batch = torch.from_numpy(np.stack(list(images)))
        tokens = tokenizer(
            shard.captions[start:stop],
            padding="max_length",
            max_length=tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        yield Batch(
            pixels=batch.pin_memory() if pin else batch,
            token_ids=tokens.pin_memory() if pin else tokens,
            seeds=[latent_seed(spec.dataset, key) for key in shard.keys[start:stop]],
        )


def encode_batch(encoders: Encoders, batch: Batch) -> Encoded:
    device, dtype = encoders.device, encoders.dtype
    with torch.inference_mode():
        images = batch.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
        images = (images.float() / 127.5 - 1).to(dtype)
        if device.type == "cuda":
            images = images.contiguous(memory_format=torch.channels_last)
        distribution = encoders.vae.encode(images).latent_dist
        # One CPU generator per sample: the same draw whatever the batch and the device.
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in batch.seeds]
        latents = distribution.sample(generator=generators) * encoders.vae.config.scaling_factor
        token_ids = batch.token_ids.to(device, non_blocking=True)
        embeddings = encoders.text_encoder(token_ids)[0]
        storage = encoders.storage_dtype
        return Encoded(
            seeds=batch.seeds,
            latents=latents.to(storage).cpu().numpy(),
            text_embeddings=embeddings.to(storage).cpu().numpy(),
            token_ids=batch.token_ids.numpy().astype(np.int32),
        )


def empty_prompt(encoders: Encoders) -> np.ndarray:
    """The text encoder's output for "" (tokens x hidden size), in the storage dtype."""
    tokens = encoders.tokenizer(
        [""],
        padding="max_length",
        max_length=encoders.tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    with torch.inference_mode():
        embedding = encoders.text_encoder(tokens.to(encoders.device))[0][0]
    return embedding.to(encoders.storage_dtype).cpu().numpy()


def join(encoders: Encoders, parts: list[Encoded], resolution: int) -> Encoded:
    """A shard's batches as one; a shard with no kept image still says what it would hold."""
    if parts:
        return Encoded(
            seeds=[seed for part in parts for seed in part.seeds],
            latents=np.concatenate([part.latents for part in parts]),
            text_embeddings=np.concatenate([part.text_embeddings for part in parts]),
            token_ids=np.concatenate([part.token_ids for part in parts]),
        )
    dtype = torch.empty(0, dtype=encoders.storage_dtype).numpy().dtype
    tokens = encoders.tokenizer.model_max_length
    side = resolution // 2 ** (len(encoders.vae.config.block_out_channels) - 1)
    return Encoded(
        seeds=[],
        latents=np.empty((0, encoders.vae.config.latent_channels, side, side), dtype),
        text_embeddings=np.empty((0, tokens, encoders.text_encoder.config.hidden_size), dtype),
        token_ids=np.empty((0, tokens), np.int32),
    )
