"""a run's jobs in id order: its messages are sent a page at a time, and each page reads
from where the last ended, not every job of the run still to send; with what says a job
is sendable, so that a re-send of a run mostly done reads the index alone

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-29 12:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0029"
down_revision: str | None = "0028"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    index = {
        "index_name": "ix_jobs_run_id_id",
        "table_name": "jobs",
        "columns": ["run_id", "id"],
        "postgresql_include": ["status", "lease_expires_at"],
    }
    if op.get_bind().dialect.name != "postgresql":
        op.create_index(**index)
        return
    # Built CONCURRENTLY, outside the upgrade's transaction: jobs is the largest table, and
    # a plain build blocks every write to it until it ends, so the last release's workers,
    # which go on through a rolling upgrade, could neither claim nor finish a job. Committed
    # apart from the version stamp: an upgrade stopped after it finds it there next time.
    with op.get_context().autocommit_block():
        op.create_index(**index, postgresql_concurrently=True, if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_run_id_id", table_name="jobs")
