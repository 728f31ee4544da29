"""train gang gatherings: a gang is keyed by its gathering (the leader's count for the job),
not by the job's attempt, which an outage gives back: a job whose gang did not gather
gathers again under a new number instead of colliding with its own last try; and each node
says when it was last seen (the database's clock), so that the leader notices a node that
died within seconds

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 05:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# RENAME COLUMN and ADD COLUMN run in place on Postgres and on SQLite (3.25 on).
def upgrade() -> None:
    op.execute("ALTER TABLE train_gangs RENAME COLUMN attempt TO gathering")
    op.add_column("train_gangs", sa.Column("seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("train_gangs", "seen_at")
    op.execute("ALTER TABLE train_gangs RENAME COLUMN gathering TO attempt")
