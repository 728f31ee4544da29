"""What the CPU prepares of an image shard for the encoders (encoders.py), batch by batch:
its images decoded once for every target (squares, or aspect-ratio buckets, with the
original size and crop SDXL is conditioned on), its captions tokenized by each of the
model's tokenizers, each sample's latent seed; on buckets, regrouped so that the VAE sees
full batches. GPU-side: imports torch, for host tensors (nothing here runs on the
device)."""

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from transformers import CLIPTokenizer

from sdq.models.datasets import latent_seed
from sdq.models.datasets.buckets import Bucket, place
from sdq.models.encode.specs import EncodeSpec
from sdq.workers.shards.images import (
    ImageShard,
    InBucket,
    pixels_at,
    pixels_in_buckets,
)

# What a shard's images are encoded into: (a job's resolution, a shape), where the shape
# is the square at the resolution or, bucketed, one aspect-ratio bucket of that area.
TargetKey = tuple[int, Bucket]


@dataclass(frozen=True)
class Decoded:
    """An image at one target: its pixels, and for a bucket or an SDXL model what SDXL's
    micro-conditioning needs (its original width and height, and the crop's top and left
    offsets)."""

    pixels: np.ndarray
    conditions: tuple[int, int, int, int] | None = None


@dataclass(frozen=True)
class Target:
    """A batch's pixels at one target as uint8 (a quarter of the bytes of floats to copy
    to the device): those of its rows the target keeps."""

    pixels: torch.Tensor  # kept x height x width x 3
    kept: list[int]  # the batch's rows they are
    left_out: int  # the batch's images too small for it
    conditions: np.ndarray | None  # kept x 4, bucketed or for SDXL (see Decoded)


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
    tokenizers: Sequence[CLIPTokenizer],
    *,
    batch_size: int,
    decoders: ThreadPoolExecutor,
    conditioned: bool,
    pin: bool,
) -> Iterator[Batch]:
    """The CPU work of encoding one image shard for the specs' targets, batch by batch:
    decoding and cropping (on `decoders`, since Pillow decodes without the GIL), with
    each image's conditions where the model is `conditioned` on them (SDXL), tokenizing
    and, to `pin`, pinning for a fast copy. On buckets, batches of a bucket's images."""
    decode = _decoder(specs, conditioned=conditioned)
    if specs[0].buckets:  # pinned once regrouped
        batches = _decoded(shard, specs, tokenizers, decode, batch_size, decoders, _unpinned)
        return by_bucket(batches, batch_size, pin=pin)
    pinned = _pinning(pin)
    return _decoded(shard, specs, tokenizers, decode, batch_size, decoders, pinned)


def _decoded(shard, specs, tokenizers, decode, batch_size, decoders, pinned) -> Iterator[Batch]:
    """The shard's images `batch_size` at a time, each decoded once for every target."""
    for start in range(0, len(shard), batch_size):
        stop = start + batch_size
        images, sizes = shard.images[start:stop], shard.found_sizes[start:stop]
        decoded = list(decoders.map(decode, images, sizes))
        yield Batch(
            rows=list(range(start, min(stop, len(shard)))),
            targets=_targets(decoded, pinned),
            token_ids=[
                pinned(token_ids_of(shard.captions[start:stop], tokenizer))
                for tokenizer in tokenizers
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


def _pinning(pin: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Pins a host tensor bound for a GPU: its copy then runs without the host waiting."""
    return (lambda tensor: tensor.pin_memory()) if pin else _unpinned


def _unpinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def by_bucket(batches: Iterable[Batch], batch_size: int, *, pin: bool) -> Iterator[Batch]:
    """Bucketed batches regrouped so that the VAE encodes full batches: a batch of images
    spreads over many buckets, a few images each, so each bucket's images wait until it
    has `batch_size` (or the images waiting reach WAITING_BATCHES batches' worth: then
    the bucket with the most goes), and the rest go at the end. Each regrouped batch is
    one target's, its rows in the shard's order, its captions encoded with it (once per
    area an image is bucketed at)."""
    waiting: dict[TargetKey, list[Batch]] = {}
    pinned = _pinning(pin)
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
        at, found = pixels_at(data, sides, found_size=size, upscale=upscale)
        original = found if conditioned else None
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
