"""training time shares: how long each step waited for its data, and how long each
checkpoint took to write, so that a run's wall time splits into training, data waits,
checkpoints and the gaps between jobs

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-24 02:15:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE, which SQLite (3.35 on) runs in place: no table is rebuilt under the
# views that name it.
def upgrade() -> None:
    op.add_column("train_steps", sa.Column("data_wait_seconds", sa.Float(), nullable=True))
    op.add_column("checkpoints", sa.Column("write_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("checkpoints", "write_seconds")
    op.drop_column("train_steps", "data_wait_seconds")
