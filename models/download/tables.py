"""What only the download kind has: the claims that tell a sample from its duplicates."""

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from sdq.models.tables import Base


class SampleClaim(Base):
    """The first sample of a dataset to bring a URL or a picture claims it; later ones are
    duplicates of it. A claim is a row, so workers on many machines agree on "first"."""

    __tablename__ = "sample_claims"

    dataset_id: Mapped[int] = mapped_column(
        ForeignKey("datasets.id", ondelete="CASCADE"), primary_key=True
    )
    # "url:<sha256 of the URL>" or "image:<sha256 of the bytes>".
    digest: Mapped[str] = mapped_column(String(80), primary_key=True)
    key: Mapped[str] = mapped_column(String(32))
