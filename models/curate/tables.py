"""What only the curate kind has: each sample's scores by one CLIP model and its heads."""

from datetime import datetime

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Index,
    String,
    UniqueConstraint,
    column,
    table,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id


class SampleScore(Base):
    """A kept sample's CLIP score (100 x the cosine of its image's and caption's CLIP
    embeddings, 0 at worst, as torchmetrics' CLIPScore), and the heads' scores of its image
    embedding: LAION's aesthetic predictor (about 1 to 10) and an NSFW probability."""

    __tablename__ = "sample_scores"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    sample_id: Mapped[int] = mapped_column(ForeignKey("samples.id", ondelete="CASCADE"))
    dataset_id: Mapped[int] = mapped_column(ForeignKey("datasets.id", ondelete="CASCADE"))
    # What scored it: the CLIP model's revision and the heads' contents (scorer_hash).
    model_revision: Mapped[str] = mapped_column(String(64))
    scorer: Mapped[str] = mapped_column(String(64))
    clip_score: Mapped[float] = mapped_column(Float)
    aesthetic: Mapped[float | None] = mapped_column(Float)
    nsfw: Mapped[float | None] = mapped_column(Float)
    scored_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("sample_id", "scorer", name="uq_sample_scores_sample_id_scorer"),
        Index("ix_sample_scores_dataset_id", "dataset_id"),
        # A sample's latest score, as sample_quality finds it (max(id) of its rows).
        Index("ix_sample_scores_sample_id_id", "sample_id", "id"),
    )


# The view of every sample with its latest scores and fate (migrations 0017, 0018), as the
# filter and the dedup jobs read it.
SAMPLE_QUALITY = table(
    "sample_quality",
    column("sample_id"),
    column("dataset"),
    column("key"),
    column("clip_score"),
    column("aesthetic"),
    column("nsfw"),
    column("model_revision"),
)
