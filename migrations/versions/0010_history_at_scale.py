"""history at scale: metrics and rollups read indexes, not every job and event; the
finished jobs' index holds finished jobs only

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23 10:20:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SETBACKS = "status IN ('pending', 'failed', 'dead')"
FINISHED = "finished_at IS NOT NULL"


def upgrade() -> None:
    op.create_index("ix_job_events_setbacks", "job_events", ["at"], postgresql_where=SETBACKS)
    op.drop_index("ix_jobs_run_id_status", table_name="jobs")
    op.create_index(
        "ix_jobs_run_id_status", "jobs", ["run_id", "status"], postgresql_include=["kind"]
    )
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"], postgresql_where=FINISHED)


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.drop_index("ix_jobs_run_id_status", table_name="jobs")
    op.create_index("ix_jobs_run_id_status", "jobs", ["run_id", "status"])
    op.drop_index("ix_job_events_setbacks", table_name="job_events")
