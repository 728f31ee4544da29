"""Image shards as the kinds that read images see them (encode, curate), on the CPU: the
kept samples of a shard and their pixels at one resolution or several. No torch here."""

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from PIL import Image

from sdq.models.datasets import ImageOptions, SampleStatus, shard_key
from sdq.models.datasets.buckets import Bucket, Placement, buckets_for, place
from sdq.models.store import MissingObject, ObjectStore
from sdq.workers.shards.pixels import in_bucket, resize, to_rgb


class ShardUnreadable(Exception):
    """The image shard is not the file the job was planned for: download it again, then
    run the job again."""


@dataclass(frozen=True)
class ImageShard:
    """The samples of one image shard that kept an image, in key order."""

    keys: list[str]
    urls: list[str]
    captions: list[str]
    sha256s: list[str]
    images: list[bytes]
    # Each image's width and height as it was found on the web, before the download
    # resized it (None where the shard does not say).
    found_sizes: list[tuple[int, int] | None]

    def __len__(self) -> int:
        return len(self.keys)

    def only(self, keys: list[str]) -> "ImageShard":
        """The samples named, in key order: a dataset made of another's samples reads the
        other's file and keeps its own members."""
        wanted = set(keys)
        rows = [index for index, key in enumerate(self.keys) if key in wanted]
        return ImageShard(
            keys=[self.keys[index] for index in rows],
            urls=[self.urls[index] for index in rows],
            captions=[self.captions[index] for index in rows],
            sha256s=[self.sha256s[index] for index in rows],
            images=[self.images[index] for index in rows],
            found_sizes=[self.found_sizes[index] for index in rows],
        )

    def lineage(self) -> dict[str, list[str]]:
        """The columns a latent shard keeps of each sample, to trace it to its source."""
        return {
            "key": self.keys,
            "url": self.urls,
            "caption": self.captions,
            "sha256": self.sha256s,
        }


def fetch_image_shard(
    store: ObjectStore, dataset: str, shard: int, sha256: str, image_column: str
) -> ImageShard:
    """A dataset's image shard from the store, as the file a job was planned for."""
    try:
        data = store.get_bytes(shard_key(dataset, shard))
    except MissingObject as error:
        raise ShardUnreadable(str(error)) from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ShardUnreadable(f"image shard {shard} of {dataset} changed since it was planned")
    try:
        return read_image_shard(data, image_column)
    except (KeyError, pa.ArrowException) as error:
        raise ShardUnreadable(f"image shard {shard}: {error}") from error


def read_image_shard(data: bytes, image_column: str) -> ImageShard:
    file = pq.ParquetFile(io.BytesIO(data))
    found = [name for name in FOUND_SIZE if name in file.schema_arrow.names]
    table = file.read(columns=["key", "url", "caption", "sha256", "status", image_column, *found])
    kept = table.filter(pc.equal(table["status"], SampleStatus.success))
    return ImageShard(
        keys=kept["key"].to_pylist(),
        urls=kept["url"].to_pylist(),
        captions=kept["caption"].to_pylist(),
        sha256s=kept["sha256"].to_pylist(),
        images=kept[image_column].to_pylist(),
        found_sizes=_found_sizes(kept, found),
    )


def _found_sizes(kept: pa.Table, found: list[str]) -> list[tuple[int, int] | None]:
    """Each image's width and height as found; None where the shard does not say."""
    if len(found) < len(FOUND_SIZE):
        return [None] * kept.num_rows
    sizes = zip(*(kept[name].to_pylist() for name in FOUND_SIZE), strict=True)
    return [None if None in size else size for size in sizes]


# The columns of an image's size as it was found (shards written before them lack them).
FOUND_SIZE = ("original_width", "original_height")


def pixels_at(
    data: bytes,
    resolutions: Sequence[int],
    *,
    found_size: tuple[int, int] | None,
    upscale: bool,
) -> tuple[dict[int, np.ndarray | None], tuple[int, int]]:
    """An image decoded once, center-cropped to each resolution: uint8 RGB, height x width
    x 3 (a no-op for a dataset already made at it). Unless `upscale`, None for each
    resolution the image is too small for: its shorter side, as found (`found_size`) or as
    stored, under it. Beside them, its original size: as found, else as stored.

    A JPEG at least twice the largest resolution is decoded at half its size (DCT scaling)
    where upscaling is allowed (`--resolution`, one target); never where it is not
    (`--resolutions`), so that a target's pixels do not depend on the others asked with it."""
    with Image.open(io.BytesIO(data)) as image:
        original = found_size or image.size
        stored = min(image.size)
        if upscale and image.format == "JPEG" and stored >= 2 * max(resolutions):
            image.draft("RGB", (image.width // 2, image.height // 2))
        rgb = to_rgb(image)
        side = stored if found_size is None else min(stored, *found_size)
        pixels = {
            resolution: np.asarray(resize(rgb, ImageOptions(resolution=resolution)))
            if upscale or side >= resolution
            else None
            for resolution in resolutions
        }
        return pixels, original


@dataclass(frozen=True)
class InBucket:
    """An image at one area: its pixels in its bucket (uint8 RGB, height x width x 3),
    where in the covering resize the crop took them from, and its size as it was found."""

    pixels: np.ndarray
    placement: Placement
    original: tuple[int, int]  # width, height


def pixels_in_buckets(
    data: bytes, sides: Sequence[int], *, found_size: tuple[int, int] | None
) -> dict[int, InBucket | Bucket]:
    """An image decoded once and placed in its bucket at each area (side x side pixels);
    where it is too small for the bucket, as stored or as found, only the bucket it would
    have gone to (never upscaled)."""
    placed: dict[int, InBucket | Bucket] = {}
    with Image.open(io.BytesIO(data)) as image:
        rgb = to_rgb(image)
        original = found_size or rgb.size
        for side in sides:
            placement = place(buckets_for(side), *rgb.size)
            bucket = placement.bucket
            if placement.scale > 1 or bucket.width > original[0] or bucket.height > original[1]:
                placed[side] = bucket
            else:
                placed[side] = InBucket(np.asarray(in_bucket(rgb, placement)), placement, original)
    return placed
