"""What only the encode kind has: latent shards, each made of one image shard by one
model at one resolution. Its samples are the image shard's kept samples, by key."""

from datetime import datetime
from typing import Any

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id, JsonDocument


class LatentShard(Base):
    __tablename__ = "latent_shards"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    # The image shard it was made of, and that file's hash as it was read.
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    image_sha256: Mapped[str] = mapped_column(String(64))
    model_name: Mapped[str] = mapped_column(Text)
    model_revision: Mapped[str] = mapped_column(String(64))
    resolution: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    samples: Mapped[int] = mapped_column(Integer)
    # Shapes and dtypes of the stored tensors, as the file's schema metadata has them.
    tensors: Mapped[dict[str, Any]] = mapped_column(JsonDocument)
    seconds: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint(
            "shard_id", "model_revision", "resolution", name="uq_latent_shards_shard_id_model"
        ),
        Index("ix_latent_shards_dataset_id", "dataset_id"),
    )
