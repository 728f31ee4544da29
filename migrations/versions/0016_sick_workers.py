"""sick_workers: GPU workers taken out of rotation after their device failed task after
task (out of memory, CUDA errors) on jobs other workers then did

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-24 09:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JsonDocument = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "sick_workers",
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("queues", JsonDocument, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker", name=op.f("pk_sick_workers")),
    )


def downgrade() -> None:
    op.drop_table("sick_workers")
