"""jobs.retry_at: when a failed job's retry is due in a queue. Beat's relay sends a failed
job again once its retry is overdue (its message lost with the broker, or left in a warm
queue that nobody consumes any more); enqueued_at keeps saying when the job was sent.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("retry_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "retry_at")
