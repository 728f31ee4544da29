"""Datasets as the producer and the workers all see them: the options that decide a
dataset's images, the specs of one download slice and of one encoded shard, and where
their shards live."""

import hashlib
import re
from dataclasses import dataclass

RESIZE_MODES = ("center_crop", "keep_ratio", "keep_ratio_largest", "border", "no")
IMAGE_FORMATS = ("jpg", "webp", "png")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SPEC_VERSION = 1


# Why a download failed, when another try later may not: the network or a busy server.
TRANSIENT_REASON = re.compile(r"timeout|dns timeout|connection failed(: \w+)?|http (429|5\d\d)")


# A URL whose host is private, loopback, link-local or reserved (SDQ_DOWNLOAD_ALLOW_NETWORKS
# opens named networks).
BLOCKED_ADDRESS = "blocked address"


def is_transient(reason: str) -> bool:
    """Whether a failure may pass: what the fetcher retries and `--retry-failed` redoes."""
    return TRANSIENT_REASON.fullmatch(reason) is not None


class SampleStatus:
    """A sample's fate, in img2dataset's words where it has them."""

    success = "success"
    failed = "failed"
    duplicate = "duplicate"
    # Left out of a dataset made of another's samples; the reason starts with the rule
    # ("aesthetic 3.9 < 5.0", "near-duplicate of KEY (cosine 0.97)").
    filtered = "filtered"


# The resize modes that keep each image's own shape: what aspect-ratio buckets are made of.
SHAPE_KEEPING = ("keep_ratio", "keep_ratio_largest", "no")


def squared_by(options: dict) -> str | None:
    """The resize mode that stored a dataset's images as squares (center_crop, border), whose
    own shape is gone; None for one that kept it."""
    mode = options.get("resize_mode", "center_crop")
    return None if mode in SHAPE_KEEPING else mode


def derived_from(options: dict) -> str | None:
    """The dataset whose image files a dataset made of another's samples reads (the one
    that downloaded them), or None for a dataset that downloaded its own."""
    return options.get("images_of")


@dataclass(frozen=True, kw_only=True)
class ImageOptions:
    """What decides a dataset's images; fixed when the dataset is made."""

    resolution: int = 256
    resize_mode: str = "center_crop"
    format: str = "jpg"
    quality: int = 95
    min_size: int = 64

    def __post_init__(self) -> None:
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize mode must be one of {', '.join(RESIZE_MODES)}")
        if self.format not in IMAGE_FORMATS:
            raise ValueError(f"format must be one of {', '.join(IMAGE_FORMATS)}")
        if not 1 <= self.quality <= 100:
            raise ValueError("quality must be between 1 and 100")
        if self.resolution < 1 or self.min_size < 0:
            raise ValueError("resolution must be positive and min size not negative")


@dataclass(frozen=True, kw_only=True)
class ListColumns:
    url: str = "url"
    caption: str = "caption"
    # Further columns of the list copied into every shard row as they are.
    save: tuple[str, ...] = ()

    @property
    def all(self) -> list[str]:
        return list(dict.fromkeys([self.url, self.caption, *self.save]))


def shard_key(dataset: str, shard: int) -> str:
    return f"datasets/{dataset}/images/{shard:05d}.parquet"


def latent_key(dataset: str, model_revision: str, resolution: int, shard: int) -> str:
    return f"{latent_prefix(dataset, model_revision, resolution)}/{shard:05d}.parquet"


def latent_prefix(
    dataset: str, model_revision: str, resolution: int, *, bucketed: bool = False
) -> str:
    """Where a dataset's latents by one model at one resolution are: squares, or
    `bucketed`, the aspect-ratio buckets of that area (`sdq encode --buckets`)."""
    shapes = "-buckets" if bucketed else ""
    return f"datasets/{dataset}/latents-{model_revision[:16]}-{resolution}{shapes}"


def bucket_latent_key(
    dataset: str, model_revision: str, resolution: int, shard: int, bucket: str
) -> str:
    """An image shard's latents in one bucket (named WIDTHxHEIGHT) of an area."""
    prefix = latent_prefix(dataset, model_revision, resolution, bucketed=True)
    return f"{prefix}/{shard:05d}-{bucket}.parquet"


def buckets_manifest_key(dataset: str, model_revision: str, resolution: int, shard: int) -> str:
    """What one image shard's encode at an area made: its latent shard in each bucket."""
    prefix = latent_prefix(dataset, model_revision, resolution, bucketed=True)
    return f"{prefix}/{shard:05d}.json"


# The tensor an SDXL model's latent shards hold beside the others: its second text
# encoder's pooled embeddings (`latent_shards.tensors` names it for the producer).
POOLED_EMBEDDINGS = "pooled_embeddings"


def empty_prompt_key(dataset: str, model_revision: str) -> str:
    """The text encoder's output for the empty prompt, stored by the dataset's encode run:
    what caption dropout trains on in place of a caption."""
    return f"datasets/{dataset}/empty-prompt-{model_revision[:16]}.npy"


def empty_pooled_key(empty_prompt: str) -> str:
    """Beside an SDXL model's empty prompt (`empty_prompt`, its key): its pooled embedding."""
    return f"{empty_prompt.removesuffix('.npy')}-pooled.npy"


def latent_seed(dataset: str, key: str) -> int:
    """The seed of a sample's draw from its latent distribution: fixed by the sample, so
    encoding again, in any batch, on any device, draws the same latents."""
    digest = hashlib.sha256(f"{dataset}/{key}".encode()).digest()
    return int.from_bytes(digest[:8]) >> 1  # torch seeds are signed 64-bit


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise ValueError(
            f"dataset name {name!r}: use letters, digits, '.', '_' and '-' (it names store keys)"
        )
    return name
