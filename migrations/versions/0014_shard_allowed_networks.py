"""shards.allowed_networks: the private networks the worker that made a shard opened
(its SDQ_DOWNLOAD_ALLOW_NETWORKS), so that a command can say which setting refused a
blocked host, and where it is set

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-24 08:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JsonDocument = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("shards", sa.Column("allowed_networks", JsonDocument, nullable=True))


def downgrade() -> None:
    op.drop_column("shards", "allowed_networks")
