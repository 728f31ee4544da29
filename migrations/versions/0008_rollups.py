"""job setup time and units, prompt-row subjects, hourly rollups for dashboards

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 01:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Migrations are history: each states the view it leaves in full, as it was then.
SECONDS = {
    "postgresql": "ROUND(EXTRACT(EPOCH FROM ({end} - {start})), 3)",
    "sqlite": "ROUND((julianday({end}) - julianday({start})) * 86400.0, 3)",
}
JOB_HISTORY = """
CREATE VIEW job_history AS
SELECT j.id AS job_id, j.run_id, j.kind, j.status, j.attempts, j.cached,
       j.worker_host AS worker, j.device,
       j.created_at, j.enqueued_at, j.started_at, j.finished_at,
       {queued_seconds} AS queued_seconds,
       j.setup_seconds, j.work_seconds,
       {total_seconds} AS total_seconds,
       j.units, j.output_uri, j.output_sha256, j.error
FROM jobs j
"""


def upgrade() -> None:
    op.add_column("jobs", sa.Column("setup_seconds", sa.Double(), nullable=True))
    op.add_column("jobs", sa.Column("units", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.add_column("generations", sa.Column("subject", sa.Text(), nullable=True))
    op.create_table(
        "hourly_rollups",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("jobs", sa.Integer(), nullable=False),
        sa.Column("cached", sa.Integer(), nullable=False),
        sa.Column("units", sa.Integer(), nullable=False),
        sa.Column("setup_seconds", sa.Double(), nullable=False),
        sa.Column("work_seconds", sa.Double(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("hour", "kind", "model", "worker", name=op.f("pk_hourly_rollups")),
    )
    _replace_job_history()


def downgrade() -> None:
    op.execute("DROP VIEW job_history")
    op.execute(_old_job_history())
    op.drop_table("hourly_rollups")
    op.drop_column("generations", "subject")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_column("jobs", "units")
    op.drop_column("jobs", "setup_seconds")


def _replace_job_history() -> None:
    op.execute("DROP VIEW job_history")
    op.execute(_job_history(JOB_HISTORY))


def _old_job_history() -> str:
    """The view as 0006 made it: without the columns this revision adds."""
    return _job_history(JOB_HISTORY.replace("j.setup_seconds, ", "").replace("j.units, ", ""))


def _job_history(template: str) -> str:
    seconds = SECONDS[op.get_bind().dialect.name]
    return template.format(
        queued_seconds=seconds.format(start="j.enqueued_at", end="j.started_at"),
        total_seconds=seconds.format(start="j.created_at", end="j.finished_at"),
    )
