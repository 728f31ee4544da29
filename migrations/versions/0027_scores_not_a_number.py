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


# Scores stored before as what they were not: NaN and infinities on Postgres, infinities on
# SQLite (its REAL holds them; NaN it refused).
NOT_FINITE = {
    "postgresql": "value IN ('NaN'::float8, 'Infinity'::float8, '-Infinity'::float8)",
    "sqlite": "value > 1.7976931348623157e308 OR value < -1.7976931348623157e308",
}


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_scores") as batch:
        batch.alter_column("value", existing_type=sa.Float(), nullable=True)
    where = NOT_FINITE[op.get_bind().dialect.name]
    op.execute(f"UPDATE checkpoint_scores SET value = NULL WHERE {where}")


def downgrade() -> None:
    op.execute("DELETE FROM checkpoint_scores WHERE value IS NULL")
    with op.batch_alter_table("checkpoint_scores") as batch:
        batch.alter_column("value", existing_type=sa.Float(), nullable=False)
