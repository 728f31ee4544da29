"""What only generation jobs have: the prompt, style, model and seed, one row per job; and
the keys `sdq serve` takes requests for images with."""

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    false,
    func,
)
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base, Id


class Generation(Base):
    """Copied out of the spec so that lookups by prompt, style and model need no JSON paths."""

    __tablename__ = "generations"

    job_id: Mapped[int] = mapped_column(
        Id, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    prompt: Mapped[str] = mapped_column(Text)
    # The prompt file row's own text, before a style was crossed in: what a gallery row shows.
    subject: Mapped[str | None] = mapped_column(Text)
    style: Mapped[str | None] = mapped_column(Text)
    model: Mapped[str] = mapped_column(Text)
    seed: Mapped[int] = mapped_column(BigInteger)
    # The prompt file's line, so a gallery can lay images out as the file did.
    source_line: Mapped[int | None] = mapped_column(Integer)
    # Jobs with equal keys can share one pipeline call.
    batch_key: Mapped[str] = mapped_column(String(64))
    # The model's safety checker flagged the image (`--safety-check`): done, not stored.
    flagged: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    __table_args__ = (
        # Trigram GIN index: `prompt ILIKE '%castle%'` stays an index scan at millions of rows.
        Index(
            "ix_generations_prompt_trgm",
            "prompt",
            postgresql_using="gin",
            postgresql_ops={"prompt": "gin_trgm_ops"},
        ),
    )


class ApiKey(Base):
    """A key `sdq serve` accepts. Only its SHA-256 is kept: a key is 32 random bytes, so
    there is no dictionary to try against the hash, and a slow hash would only slow every
    request."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Id, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.current_timestamp()
    )
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
