"""latent_shards.too_small: a shard's images left out of a resolution they are smaller than

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-27 14:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "latent_shards",
        sa.Column("too_small", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    # SQLite drops a column in place (3.35+): a copied table would break the views on it.
    op.drop_column("latent_shards", "too_small")
