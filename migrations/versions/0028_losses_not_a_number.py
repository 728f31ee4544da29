"""train_steps.loss may be NULL: the loss of a diverged run's step, not a finite number.
SQLite refused the NaN (its NULL met NOT NULL) and the job failed on its records, where
Postgres stored NaN.

Revision ID: 0028
Revises: 0027
Create Date: 2026-11-28 16:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Losses stored before as what they were not: NaN and infinities on Postgres, infinities on
# SQLite (its REAL holds them; NaN it refused).
NOT_FINITE = {
    "postgresql": "loss IN ('NaN'::float8, 'Infinity'::float8, '-Infinity'::float8)",
    "sqlite": "loss > 1.7976931348623157e308 OR loss < -1.7976931348623157e308",
}


def upgrade() -> None:
    with op.batch_alter_table("train_steps") as batch:
        batch.alter_column("loss", existing_type=sa.Float(), nullable=True)
    where = NOT_FINITE[op.get_bind().dialect.name]
    op.execute(f"UPDATE train_steps SET loss = NULL WHERE {where}")


def downgrade() -> None:
    op.execute("DELETE FROM train_steps WHERE loss IS NULL")
    with op.batch_alter_table("train_steps") as batch:
        batch.alter_column("loss", existing_type=sa.Float(), nullable=False)
