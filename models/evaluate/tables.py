"""What only the evaluate kind has: each score of each model it evaluated."""

from datetime import datetime

from sqlalchemy import (
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id, JsonDocument


class CheckpointScore(Base):
    """One metric's value for the model an evaluate job scored: a train run's checkpoint
    (`run_id`, `step`), or any model (no run). The same model scored with the same spec
    (`spec_hash`) is served from these rows, never computed again."""

    __tablename__ = "checkpoint_scores"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int | None] = mapped_column(Integer)
    model_name: Mapped[str] = mapped_column(Text)
    model_revision: Mapped[str] = mapped_column(String(64))
    spec_hash: Mapped[str] = mapped_column(String(64))
    metric: Mapped[str] = mapped_column(String(32))
    # None: not a finite number (a diverged model's loss; distances over its NaN images).
    value: Mapped[float | None] = mapped_column(Float)
    samples: Mapped[int] = mapped_column(Integer)  # images or held-out samples it is over
    # The revisions of what scored it (the CLIP model), by role.
    scorers: Mapped[dict[str, str]] = mapped_column(JsonDocument)
    scored_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )

    __table_args__ = (
        UniqueConstraint("job_id", "metric", name="uq_checkpoint_scores_job_id_metric"),
        Index("ix_checkpoint_scores_run_id_step", "run_id", "step"),
        Index("ix_checkpoint_scores_spec_hash", "spec_hash"),
    )
