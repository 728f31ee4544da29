"""checkpoint_scores.value may be NULL: a score that is not a finite number (a diverged
model's held-out loss, distances over its NaN images). SQLite cannot hold NaN, and a
NULL where the column refused one lost the evaluation's every other score.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-28 14:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_scores") as batch:
        batch.alter_column("value", existing_type=sa.Float(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM checkpoint_scores WHERE value IS NULL")
    with op.batch_alter_table("checkpoint_scores") as batch:
        batch.alter_column("value", existing_type=sa.Float(), nullable=False)
