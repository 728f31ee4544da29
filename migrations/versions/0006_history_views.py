"""history views: job_history (a row per job) and run_summary (a row per run); a job's
setup time and units, a generation's subject

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 22:50:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Seconds between two timestamps, to the millisecond, in each dialect's words.
SECONDS = {
    "postgresql": "ROUND(EXTRACT(EPOCH FROM ({end} - {start})), 3)",
    "sqlite": "ROUND((julianday({end}) - julianday({start})) * 86400.0, 3)",
}

# One row per job: its run, kind, status, timings (waiting in the queue, working), the
# worker and device that last held it, its attempts and its output.
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

# One row per run: jobs by status, start and end, throughput of the jobs done so far.
RUN_SUMMARY = """
CREATE VIEW run_summary AS
SELECT r.id AS run_id, r.kind, r.source, r.job_count AS jobs,
       SUM(CASE WHEN j.status = 'succeeded' THEN 1 ELSE 0 END) AS succeeded,
       SUM(CASE WHEN j.status = 'succeeded' AND j.cached THEN 1 ELSE 0 END) AS cached,
       SUM(CASE WHEN j.status IN ('pending', 'queued') THEN 1 ELSE 0 END) AS waiting,
       SUM(CASE WHEN j.status = 'running' THEN 1 ELSE 0 END) AS running,
       SUM(CASE WHEN j.status = 'failed' THEN 1 ELSE 0 END) AS failed,
       SUM(CASE WHEN j.status = 'dead' THEN 1 ELSE 0 END) AS dead,
       SUM(CASE WHEN j.status = 'cancelled' THEN 1 ELSE 0 END) AS cancelled,
       r.created_at, MIN(j.started_at) AS first_started, r.finished_at,
       {seconds} AS seconds,
       ROUND(SUM(CASE WHEN j.status = 'succeeded' THEN 1 ELSE 0 END) / NULLIF({seconds}, 0), 3)
           AS jobs_per_second
FROM runs r
LEFT JOIN jobs j ON j.run_id = r.id
GROUP BY r.id, r.kind, r.source, r.job_count, r.created_at, r.finished_at
"""


def upgrade() -> None:
    # What the history answers "where did the time go" and "what was made" with.
    op.add_column("jobs", sa.Column("setup_seconds", sa.Double(), nullable=True))
    op.add_column("jobs", sa.Column("units", sa.Integer(), nullable=True))
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.add_column("generations", sa.Column("subject", sa.Text(), nullable=True))
    seconds = SECONDS[op.get_bind().dialect.name]
    op.execute(
        JOB_HISTORY.format(
            queued_seconds=seconds.format(start="j.enqueued_at", end="j.started_at"),
            total_seconds=seconds.format(start="j.created_at", end="j.finished_at"),
        )
    )
    op.execute(
        RUN_SUMMARY.format(
            seconds=seconds.format(
                start="r.created_at", end="COALESCE(r.finished_at, MAX(j.finished_at))"
            )
        )
    )


def downgrade() -> None:
    op.execute("DROP VIEW run_summary")
    op.execute("DROP VIEW job_history")
    op.drop_column("generations", "subject")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_column("jobs", "units")
    op.drop_column("jobs", "setup_seconds")
