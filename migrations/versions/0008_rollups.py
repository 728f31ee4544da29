"""hourly rollups for dashboards

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 01:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hourly_rollups",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.Column("cached", sa.Integer(), nullable=False),
        sa.Column("units", sa.Integer(), nullable=False),
        sa.Column("setup_seconds", sa.Double(), nullable=False),
        sa.Column("work_seconds", sa.Double(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("hour", "kind", "model", "worker", name=op.f("pk_hourly_rollups")),
    )


def downgrade() -> None:
    op.drop_table("hourly_rollups")
