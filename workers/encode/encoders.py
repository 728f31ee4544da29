"""A model's VAE and text encoder (SDXL's two), loaded once per worker process, and batches
encoded with them: images to scaled samples of their latent distributions, captions to
CLIP hidden states (for SDXL, both encoders' side by side and the second's pooled
embedding, as its pipeline makes them). GPU-side: imports torch. The U-Net is never loaded
for this."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from sdq.models import tiny
from sdq.models.datasets import latent_seed
from sdq.models.datasets.buckets import Bucket, place
from sdq.models.encode.specs import EncodeSpec
from sdq.workers.gpu import device_name, release_device_memory, torch_dtype
from sdq.workers.shards.images import (
    ImageShard,
    InBucket,
    pixels_at,
    pixels_in_buckets,
    stored_size,
)
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


# What a shard's images are encoded into: (a job's resolution, a shape), where the shape
# is the square at the resolution or, bucketed, one aspect-ratio bucket of that area.
TargetKey = tuple[int, Bucket]


@dataclass(frozen=True)
class Decoded:
    """An image at one target: its pixels, and for a bucket what SDXL's micro-conditioning
    needs (its original width and height, and the crop's top and left offsets)."""

    pixels: np.ndarray
    conditions: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class Target:
    """A batch's pixels at one target as uint8 (a quarter of the bytes of floats to copy
    to the device): those of its rows the target keeps."""

    pixels: torch.Tensor  # kept x height x width x 3
    kept: list[int]  # the batch's rows they are
    left_out: int  # the batch's images too small for it
    conditions: np.ndarray | None  # kept x 4, bucketed (see Decoded)


@dataclass(frozen=True)
class Batch:
    """One batch as the CPU prepared it, each image decoded once for every target: its
    pixels at each, token ids, and each sample's latent seed."""

    rows: list[int]  # the shard's row of each of its samples
    targets: dict[TargetKey, Target]
    token_ids: list[torch.Tensor]  # batch x tokens, by each of the model's tokenizers
    seeds: list[int]

    def kept_rows(self, key: TargetKey) -> list[int]:
        """The shard's rows the target keeps of this batch."""
        return [self.rows[row] for row in self.targets[key].kept]


def square(resolution: int) -> TargetKey:
    return resolution, Bucket(resolution, resolution)


def prepare_batches(
    shard: ImageShard,
    specs: Sequence[EncodeSpec],
    encoders: Encoders,
    *,
    batch_size: int,
    decoders: ThreadPoolExecutor,
) -> Iterator[Batch]:
    """The CPU work of encoding one image shard for the specs' targets, batch by batch:
    decoding and cropping (on `decoders`, since Pillow decodes without the GIL),
    tokenizing and pinning for a fast copy. On buckets, batches of a bucket's images."""
    if specs[0].buckets:  # pinned once regrouped
        batches = _decoded(shard, specs, encoders, batch_size, decoders, pinned=_unpinned)
        return by_bucket(batches, encoders, batch_size)
    return _decoded(shard, specs, encoders, batch_size, decoders, pinned=_pinning(encoders))


def _decoded(shard, specs, encoders, batch_size, decoders, *, pinned) -> Iterator[Batch]:
    """The shard's images `batch_size` at a time, each decoded once for every target."""
    decode = _decoder(specs, conditioned=encoders.sdxl)
    for start in range(0, len(shard), batch_size):
        stop = start + batch_size
        images, sizes = shard.images[start:stop], shard.found_sizes[start:stop]
        decoded = list(decoders.map(decode, images, sizes))
        yield Batch(
            rows=list(range(start, min(stop, len(shard)))),
            targets=_targets(decoded, pinned),
            token_ids=[
                pinned(token_ids_of(shard.captions[start:stop], tokenizer))
                for tokenizer in encoders.tokenizers
            ],
            seeds=[latent_seed(specs[0].dataset, key) for key in shard.keys[start:stop]],
        )


def token_ids_of(texts: list[str], tokenizer: CLIPTokenizer) -> torch.Tensor:
    """The texts' token ids, each padded or cut to the tokenizer's length."""
    return tokenizer(
        texts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def _pinning(encoders: Encoders) -> Callable[[torch.Tensor], torch.Tensor]:
    """Pins a host tensor bound for a GPU: its copy then runs without the host waiting."""
    return (lambda tensor: tensor.pin_memory()) if encoders.device.type == "cuda" else _unpinned


def _unpinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def by_bucket(batches: Iterable[Batch], encoders: Encoders, batch_size: int) -> Iterator[Batch]:
    """Bucketed batches regrouped so that the VAE encodes full batches: a batch of images
    spreads over many buckets, a few images each, so each bucket's images wait until it
    has `batch_size` (or the images waiting reach WAITING_BATCHES batches' worth: then
    the bucket with the most goes), and the rest go at the end. Each regrouped batch is
    one target's, its rows in the shard's order, its captions encoded with it (once per
    area an image is bucketed at)."""
    waiting: dict[TargetKey, list[Batch]] = {}
    pinned = _pinning(encoders)
    for batch in batches:
        for key in batch.targets:
            waiting.setdefault(key, []).append(_alone(batch, key))
        for key in _full(waiting, batch_size):
            yield _joined(waiting.pop(key), key, pinned)
    for key, parts in waiting.items():
        yield _joined(parts, key, pinned)


# The images that may wait for their bucket to fill, in batches: bounds the host memory
# regrouping takes (a batch of 1,024 px images in uint8 is ~100 MB).
WAITING_BATCHES = 4


def _full(waiting: dict[TargetKey, list[Batch]], batch_size: int) -> list[TargetKey]:
    """The targets whose images go now: those with a batch of them, and while too many
    wait, those with the most."""

    def kept(key: TargetKey) -> int:
        return sum(len(part.rows) for part in waiting[key])

    full = [key for key in waiting if kept(key) >= batch_size]
    left = sorted((key for key in waiting if key not in full), key=kept, reverse=True)
    while left and sum(map(kept, left)) > WAITING_BATCHES * batch_size:
        full.append(left.pop(0))
    return full


def _alone(batch: Batch, key: TargetKey) -> Batch:
    """The batch's kept images of one target, with their rows' token ids and seeds."""
    target = batch.targets[key]
    kept = target.kept
    alone = Target(target.pixels, list(range(len(kept))), target.left_out, target.conditions)
    return Batch(
        rows=[batch.rows[row] for row in kept],
        targets={key: alone},
        token_ids=[ids[kept] for ids in batch.token_ids],
        seeds=[batch.seeds[row] for row in kept],
    )


def _joined(parts: list[Batch], key: TargetKey, pinned) -> Batch:
    """One target's images of several batches as one batch."""
    targets = [part.targets[key] for part in parts]
    conditions = [target.conditions for target in targets if target.conditions is not None]
    rows = [row for part in parts for row in part.rows]
    joined = Target(
        pinned(torch.cat([target.pixels for target in targets])),
        list(range(len(rows))),
        left_out=sum(target.left_out for target in targets),
        conditions=np.concatenate(conditions) if conditions else None,
    )
    tokenizers = zip(*(part.token_ids for part in parts), strict=True)
    return Batch(
        rows=rows,
        targets={key: joined},
        token_ids=[pinned(torch.cat(ids)) for ids in tokenizers],
        seeds=[seed for part in parts for seed in part.seeds],
    )


Decode = Callable[[bytes, tuple[int, int] | None], dict[TargetKey, Decoded | None]]


def _decoder(specs: Sequence[EncodeSpec], *, conditioned: bool) -> Decode:
    """An image's targets: None where it is too small for one (and left out); squares with
    their conditions where the model is `conditioned` on them (SDXL)."""
    sides = [spec.resolution for spec in specs]
    if specs[0].buckets:
        return lambda data, size: _bucketed(pixels_in_buckets(data, sides, found_size=size))
    upscale = not specs[0].leave_out_smaller
    padded = bool(specs[0].padded)

    def squares(data: bytes, size: tuple[int, int] | None) -> dict[TargetKey, Decoded | None]:
        at = pixels_at(data, sides, found_size=size, upscale=upscale)
        original = (size or stored_size(data)) if conditioned else None
        return {
            square(side): None
            if pixels is None
            else Decoded(pixels, _cropped(original, side, padded=padded))
            for side, pixels in at.items()
        }

    return squares


def _cropped(
    original: tuple[int, int] | None, side: int, *, padded: bool
) -> tuple[int, int, int, int] | None:
    """The conditions of an image of the `original` size center-cropped to a square, or
    `padded` to one (a `border` download): nothing cropped."""
    if original is None:
        return None
    if padded:
        return (*original, 0, 0)
    placement = place((Bucket(side, side),), *original)
    return (*original, placement.top, placement.left)


def _bucketed(placed: dict[int, InBucket | Bucket]) -> dict[TargetKey, Decoded | None]:
    decoded: dict[TargetKey, Decoded | None] = {}
    for side, image in placed.items():
        if isinstance(image, Bucket):  # too small for the bucket it would go to
            decoded[side, image] = None
        else:
            where = image.placement
            conditions = (*image.original, where.top, where.left)
            decoded[side, where.bucket] = Decoded(image.pixels, conditions)
    return decoded


def _targets(decoded: list[dict[TargetKey, Decoded | None]], pinned) -> dict[TargetKey, Target]:
    keys = dict.fromkeys(key for image in decoded for key in image)
    return {key: _target(decoded, key, pinned) for key in keys}


def _target(decoded: list[dict[TargetKey, Decoded | None]], key: TargetKey, pinned) -> Target:
    placed = [row for row, image in enumerate(decoded) if key in image]
    kept = [row for row in placed if decoded[row][key] is not None]
    if not kept:
        bucket = key[1]
        empty = torch.empty(0, bucket.height, bucket.width, 3, dtype=torch.uint8)
        return Target(empty, [], len(placed), None)
    images = [decoded[row][key] for row in kept]
    conditions = [image.conditions for image in images]
    return Target(
        pinned(torch.from_numpy(np.stack([image.pixels for image in images]))),
        kept,
        left_out=len(placed) - len(kept),
        conditions=None if conditions[0] is None else np.array(conditions, np.int32),
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
