"""maintenance ticks: when each of beat's periodic tasks last ran

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 22:55:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "maintenance_ticks",
        sa.Column("task", sa.Text(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "result",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("task", name=op.f("pk_maintenance_ticks")),
    )


def downgrade() -> None:
    op.drop_table("maintenance_ticks")
