"""A model's VAE and text encoder (SDXL's two), loaded once per worker process, and batches
encoded with them: images to scaled samples of their latent distributions, captions to
CLIP hidden states (for SDXL, both encoders' side by side and the second's pooled
embedding, as its pipeline makes them). What the CPU prepares for them is batches.py.
GPU-side: imports torch. The U-Net is never loaded for this."""

from dataclasses import dataclass, replace

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdq.models import tiny
from sdq.models.datasets.buckets import Bucket
from sdq.models.encode.specs import EncodeSpec
from sdq.workers.encode.batches import Batch, Target, TargetKey, token_ids_of
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
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
    # SDXL's second text encoder (with its projection: the pooled embedding) and tokenizer.
    text_encoder_2: CLIPTextModelWithProjection | None = None
    tokenizer_2: CLIPTokenizer | None = None

    @property
    def storage_dtype(self) -> torch.dtype:
        # NumPy and parquet have no bfloat16; float32 holds it exactly.
        return torch.float32 if self.dtype == torch.bfloat16 else self.dtype

    @property
    def sdxl(self) -> bool:
        return self.text_encoder_2 is not None

    @property
    def tokenizers(self) -> list[CLIPTokenizer]:
        return [self.tokenizer] if self.tokenizer_2 is None else [self.tokenizer, self.tokenizer_2]

    @property
    def pins(self) -> bool:
        """Whether host tensors bound for its device are pinned (a GPU's copies then run
        without the host waiting)."""
        return self.device.type == "cuda"

    @property
    def vae_dtype(self) -> torch.dtype:
        # SDXL's VAE overflows in fp16 (its config says force_upcast): its pipeline and
        # training script run it in fp32.
        upcast = self.sdxl and self.vae.config.get("force_upcast", False)
        return torch.float32 if upcast and self.dtype == torch.float16 else self.dtype


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
            loaded = Encoders(
                build_vae(), build_text_encoder(), build_tokenizer(), LOADED_ON, dtype
            )
        else:
            loaded = _from_pretrained(self.files, spec, dtype)
        device = torch.device(device_name())
        vae = loaded.vae.to(device, loaded.vae_dtype).eval().requires_grad_(False)
        if device.type == "cuda":
            # Convolutions in channels-last layout run on tensor cores without transposes.
            vae = vae.to(memory_format=torch.channels_last)

        def placed(encoder):  # a text encoder; None: the second of a model with one
            if encoder is None:
                return None
            return encoder.to(device, dtype).eval().requires_grad_(False)

        return replace(
            loaded,
            vae=vae,
            text_encoder=placed(loaded.text_encoder),
            text_encoder_2=placed(loaded.text_encoder_2),
            device=device,
        )


# Where encoders are built or loaded, before they go to the device.
LOADED_ON = torch.device("cpu")


def _from_pretrained(files: ModelFiles, spec: EncodeSpec, dtype: torch.dtype) -> Encoders:
    """A pipeline's encoders from its files: its VAE, its text encoder and tokenizer, and an
    SDXL pipeline's second ones."""
    where = files.locate(spec.model_source, spec.model_revision)
    found = {"revision": where.revision}

    def load(kind, subfolder: str, **typed):
        return kind.from_pretrained(where.path, subfolder=subfolder, **typed, **found)

    second: dict = {}
    listed = DiffusionPipeline.load_config(where.path, **found).get("text_encoder_2")
    if listed is not None and listed[0] is not None:  # SDXL's model_index names it
        second = {
            "text_encoder_2": load(CLIPTextModelWithProjection, "text_encoder_2", dtype=dtype),
            "tokenizer_2": load(CLIPTokenizer, "tokenizer_2"),
        }
    return Encoders(
        vae=load(AutoencoderKL, "vae"),  # as stored: it goes to its own dtype on the device
        text_encoder=load(CLIPTextModel, "text_encoder", dtype=dtype),
        tokenizer=load(CLIPTokenizer, "tokenizer"),
        device=LOADED_ON,
        dtype=dtype,
        **second,
    )


def encode_batch(encoders: Encoders, batch: Batch) -> dict[TargetKey, Encoded]:
    """The batch at each of its targets: its captions encoded once, its images by the VAE
    at each."""
    if not batch.rows:  # a bucket whose images were all too small for it
        return {key: _nothing(encoders, key[1]) for key in batch.targets}
    device = encoders.device
    with torch.inference_mode():
        token_ids = [ids.to(device, non_blocking=True) for ids in batch.token_ids]
        embeddings, pooled = _text(encoders, token_ids)
        stored_ids = batch.token_ids[0].numpy().astype(np.int32)
        return {
            key: Encoded(
                seeds=[batch.seeds[row] for row in target.kept],
                latents=_latents(encoders, target, [batch.seeds[row] for row in target.kept]),
                text_embeddings=embeddings[target.kept],
                token_ids=stored_ids[target.kept],
                conditions=target.conditions,
                pooled_embeddings=None if pooled is None else pooled[target.kept],
            )
            for key, target in batch.targets.items()
        }


def _text(
    encoders: Encoders, token_ids: list[torch.Tensor]
) -> tuple[np.ndarray, np.ndarray | None]:
    """The text encoder's hidden states, in the storage dtype; for SDXL, its two encoders'
    penultimate hidden states side by side and the second's pooled embedding, as
    StableDiffusionXLPipeline.encode_prompt makes them."""

    def stored(tensor: torch.Tensor) -> np.ndarray:
        return tensor.to(encoders.storage_dtype).cpu().numpy()

    if not encoders.sdxl:
        return stored(encoders.text_encoder(token_ids[0])[0]), None
    first = encoders.text_encoder(token_ids[0], output_hidden_states=True)
    second = encoders.text_encoder_2(token_ids[1], output_hidden_states=True)
    hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
    return stored(hidden), stored(second.text_embeds)


def _latents(encoders: Encoders, target: Target, seeds: list[int]) -> np.ndarray:
    """The VAE's scaled samples of the target's pixels, each drawn from its seed."""
    device, dtype = encoders.device, encoders.vae_dtype
    if not seeds:
        return _no_latents(encoders, Bucket(target.pixels.shape[2], target.pixels.shape[1]))
    images = target.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
    images = (images.float() / 127.5 - 1).to(dtype)
    if device.type == "cuda":
        images = images.contiguous(memory_format=torch.channels_last)
    distribution = encoders.vae.encode(images).latent_dist
    # One CPU generator per sample: the same draw whatever the batch and the device.
    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    latents = distribution.sample(generator=generators) * encoders.vae.config.scaling_factor
    return latents.to(encoders.storage_dtype).cpu().numpy()


def empty_prompt(encoders: Encoders) -> tuple[np.ndarray, np.ndarray | None]:
    """The text encoders' output for "" (tokens x hidden size, and SDXL's pooled
    embedding), in the storage dtype."""
    token_ids = [token_ids_of([""], tokenizer) for tokenizer in encoders.tokenizers]
    with torch.inference_mode():
        embeddings, pooled = _text(encoders, [ids.to(encoders.device) for ids in token_ids])
    return embeddings[0], None if pooled is None else pooled[0]


def join(encoders: Encoders, parts: list[Encoded], shape: Bucket) -> Encoded:
    """A shard's batches as one; a shard with no kept image still says what it would hold
    (a batch that kept none has no conditions to say it)."""
    parts = [part for part in parts if part.seeds]
    if parts:
        conditions = [part.conditions for part in parts if part.conditions is not None]
        pooled = [part.pooled_embeddings for part in parts if part.pooled_embeddings is not None]
        return Encoded(
            seeds=[seed for part in parts for seed in part.seeds],
            latents=np.concatenate([part.latents for part in parts]),
            text_embeddings=np.concatenate([part.text_embeddings for part in parts]),
            token_ids=np.concatenate([part.token_ids for part in parts]),
            conditions=np.concatenate(conditions) if conditions else None,
            pooled_embeddings=np.concatenate(pooled) if pooled else None,
        )
    return _nothing(encoders, shape)


def _nothing(encoders: Encoders, shape: Bucket) -> Encoded:
    """No sample, in the shapes and dtypes a sample's tensors would have."""
    tokens = encoders.tokenizer.model_max_length
    latents = _no_latents(encoders, shape)
    text_encoders = [encoders.text_encoder, encoders.text_encoder_2]
    width = sum(encoder.config.hidden_size for encoder in text_encoders if encoder is not None)
    second = encoders.text_encoder_2
    return Encoded(
        seeds=[],
        latents=latents,
        text_embeddings=np.empty((0, tokens, width), latents.dtype),
        token_ids=np.empty((0, tokens), np.int32),
        conditions=np.empty((0, 4), np.int32) if second is not None else None,
        pooled_embeddings=None
        if second is None
        else np.empty((0, second.config.projection_dim), latents.dtype),
    )


def _no_latents(encoders: Encoders, shape: Bucket) -> np.ndarray:
    """No sample's latents, in the shape and dtype a sample's would have."""
    dtype = torch.empty(0, dtype=encoders.storage_dtype).numpy().dtype
    scale = 2 ** (len(encoders.vae.config.block_out_channels) - 1)
    channels = encoders.vae.config.latent_channels
    return np.empty((0, channels, shape.height // scale, shape.width // scale), dtype)
