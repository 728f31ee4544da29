"""byte-ordered spec hashes: a hash prefix is an index range

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 10:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _collate_spec_hash(collation: str | None) -> None:
    # Postgres only: SQLite compares text byte by byte already. The rows stay as they are;
    # only the index on the hash is built again.
    if op.get_bind().dialect.name != "postgresql":
        return
    op.alter_column(
        "jobs",
        "spec_hash",
        type_=sa.String(length=64, collation=collation),
        existing_type=sa.String(length=64),
        existing_nullable=False,
    )


def upgrade() -> None:
    _collate_spec_hash("C")


def downgrade() -> None:
    _collate_spec_hash(None)
