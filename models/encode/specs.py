"""An encode job's specification: one image shard, one model, one resolution (a shard's
jobs at several resolutions go in one message, and its images are decoded once for all)."""

from dataclasses import asdict, dataclass, replace
from typing import Any

from sdq.models.datasets import (
    SPEC_VERSION,
    bucket_latent_key,
    buckets_manifest_key,
    empty_prompt_key,
    latent_key,
)
from sdq.models.specs import canonical_sha256


@dataclass(frozen=True, kw_only=True)
class EncodeSpec:
    """One encode job: image shard `shard` of the dataset, as the file whose hash is
    `shard_sha256`, made into VAE latents and text embeddings by one model."""

    dataset: str
    shard: int
    shard_sha256: str
    image_format: str  # the shard's image column
    model_name: str
    model_source: str
    model_revision: str
    resolution: int
    dtype: str
    # A dataset made of another's samples (`sdq dataset filter`) reads the images where
    # they were downloaded, the dataset `images_of`, and encodes only its members `keys`.
    images_of: str | None = None
    keys: list[str] | None = None
    # Encoded at several resolutions at once (`--resolutions`): an image smaller than this
    # one is left out of it ("too small for 512"), never upscaled.
    leave_out_smaller: bool | None = None
    # In aspect-ratio buckets of the area resolution x resolution (`--buckets`): each image
    # in the bucket of the nearest shape, covered and cropped least, never upscaled.
    buckets: bool | None = None
    # Downloaded with `--resize-mode border`: each image padded to its square, not cropped.
    padded: bool | None = None

    @property
    def source(self) -> "EncodeSpec":
        """What decides the images it reads and how: the same for a shard's every target."""
        return replace(self, resolution=0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EncodeSpec":
        return cls(**data)

    def hash(self) -> str:
        # As for images: where the model was found does not change what it computes.
        identity = {name: value for name, value in self.to_dict().items() if value is not None}
        del identity["model_name"], identity["model_source"]
        return canonical_sha256({**identity, "version": SPEC_VERSION})

    @property
    def latent_key(self) -> str:
        """The job's output: its latent shard, or bucketed, the manifest of its buckets'."""
        where = (self.dataset, self.model_revision, self.resolution, self.shard)
        return buckets_manifest_key(*where) if self.buckets else latent_key(*where)

    def shape_key(self, bucket: str) -> str:
        """Where its latents in one shape are: its latent shard, or bucketed, the one of
        that bucket (WIDTHxHEIGHT)."""
        if not self.buckets:
            return self.latent_key
        return bucket_latent_key(
            self.dataset, self.model_revision, self.resolution, self.shard, bucket
        )

    @property
    def empty_prompt_key(self) -> str:
        return empty_prompt_key(self.dataset, self.model_revision)
