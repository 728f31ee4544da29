"""Datasets, as every kind that reads or adds to one sees them: a dataset is made of image
shards; each shard is one slice of an input list (file and row range), done by one download
job and written as one parquet file. Every row of every slice becomes a sample, kept or
not, with the reason in words. A dataset made of another's samples (a filtered one) has a
shard row for each of its parent's files and a sample row for each of its kept samples,
with no image copied: its options name the dataset whose files hold the images.

Latent shards are a shard's VAE latents and text embeddings made by one model at one
resolution, which training reads; latent samples say which sample each of their rows is.
"""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id, JsonDocument


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    # What decides the images (resolution, resize mode, format...): fixed at creation, so
    # every shard of a dataset is made alike.
    options: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )


class Shard(Base):
    """One input slice and the parquet file made of it. Written at submit (the slice) and
    completed by the job that downloads it (the file, its counts and timings)."""

    __tablename__ = "shards"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    # The input list as the workers read it, what its content was, and the row range.
    source_uri: Mapped[str] = mapped_column(Text)
    source_id: Mapped[str] = mapped_column(String(64))
    first_row: Mapped[int] = mapped_column(BigInteger)
    row_count: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str | None] = mapped_column(Text)
    # Of the shard file: what names its content for the jobs that read it.
    sha256: Mapped[str | None] = mapped_column(String(64))
    # Status -> rows, e.g. {"success": 951, "failed": 41, "duplicate": 8}.
    counts: Mapped[dict[str, int] | None] = mapped_column(JsonDocument)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    seconds: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The private networks the worker that made the file opened (its
    # SDQ_DOWNLOAD_ALLOW_NETWORKS): what refused its blocked hosts, set where it fetched.
    allowed_networks: Mapped[list[str] | None] = mapped_column(JsonDocument)

    __table_args__ = (
        UniqueConstraint("dataset_id", "number", name="uq_shards_dataset_id_number"),
        UniqueConstraint(
            "dataset_id", "source_id", "first_row", name="uq_shards_dataset_id_source_id"
        ),
    )


class Sample(Base):
    """One row of an input list: where it came from, what became of it and why."""

    __tablename__ = "samples"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    key: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(Text)
    caption: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # success | failed | duplicate | filtered
    reason: Mapped[str | None] = mapped_column(Text)
    # Of the bytes as downloaded, before any resizing: what names the picture.
    sha256: Mapped[str | None] = mapped_column(String(64))
    width: Mapped[int | None] = mapped_column(Integer)
    height: Mapped[int | None] = mapped_column(Integer)
    original_width: Mapped[int | None] = mapped_column(Integer)
    original_height: Mapped[int | None] = mapped_column(Integer)
    # In a dataset made of another's samples (`sdq dataset filter`): the sample of the
    # dataset that downloaded it, whose image file and scores it shares.
    origin_id: Mapped[int | None] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"))

    __table_args__ = (
        UniqueConstraint("dataset_id", "key", name="uq_samples_dataset_id_key"),
        Index("ix_samples_shard_id", "shard_id"),
        Index("ix_samples_dataset_id_status", "dataset_id", "status"),
        # "Where did this picture come from": from an image's hash to its URL and caption.
        Index("ix_samples_sha256", "sha256"),
        # Its copies in datasets made of its dataset's samples.
        Index("ix_samples_origin_id", "origin_id"),
    )


class LatentShard(Base):
    __tablename__ = "latent_shards"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    # The image shard it was made of, and that file's hash as it was read.
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    image_sha256: Mapped[str] = mapped_column(String(64))
    model_name: Mapped[str] = mapped_column(Text)
    model_revision: Mapped[str] = mapped_column(String(64))
    # Its samples' shape in pixels: a square at the resolution, or, `bucketed`, one
    # aspect-ratio bucket of the area resolution x resolution (`sdq encode --buckets`).
    resolution: Mapped[int] = mapped_column(Integer)
    bucketed: Mapped[bool] = mapped_column(Boolean, server_default=false())
    width: Mapped[int] = mapped_column(Integer)
    height: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    samples: Mapped[int] = mapped_column(Integer)
    # The shard's images left out of this resolution, too small for it (never upscaled);
    # bucketed, those of its images that went to this bucket.
    too_small: Mapped[int] = mapped_column(Integer, server_default="0")
    # Whether its rows' samples are recorded (latent_samples): a shard encoded before they
    # were stands for its image shard's kept samples in the lineage views.
    rows_recorded: Mapped[bool] = mapped_column(Boolean, server_default=false())
    # Shapes and dtypes of the stored tensors, as the file's schema metadata has them.
    tensors: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    seconds: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint(
            "shard_id",
            "model_revision",
            "resolution",
            "bucketed",
            "width",
            "height",
            name="uq_latent_shards_shard_id_model",
        ),
        Index("ix_latent_shards_dataset_id", "dataset_id"),
    )


class LatentSample(Base):
    """Which sample a latent shard's row is: the link that makes a run's lineage exact (an
    image shard's samples too small for a resolution are in none of its latent shards, and
    each sample is in one bucket's)."""

    __tablename__ = "latent_samples"

    latent_shard_id: Mapped[int] = mapped_column(
        ForeignKey("latent_shards.id", ondelete="CASCADE"), primary_key=True
    )
    latent_row: Mapped[int] = mapped_column(Integer, primary_key=True)
    sample_id: Mapped[int] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"))

    # A sample deleted (its dataset dropped) finds its rows without reading them all.
    __table_args__ = (Index("ix_latent_samples_sample_id", "sample_id"),)
