"""generations.flagged: an image the model's safety checker flagged (`--safety-check`),
done and not stored; the history views show it (job_history per job, run_summary per run)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 09:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SECONDS = {
    "postgresql": "ROUND(EXTRACT(EPOCH FROM ({end} - {start})), 3)",
    "sqlite": "ROUND((julianday({end}) - julianday({start})) * 86400.0, 3)",
}

# As 0006 made it, with `flagged` (NULL for jobs that render nothing).
JOB_HISTORY = """
CREATE VIEW job_history AS
SELECT j.id AS job_id, j.run_id, j.kind, j.status, j.attempts, j.cached,
       j.worker_host AS worker, j.device,
       j.created_at, j.enqueued_at, j.started_at, j.finished_at,
       {queued_seconds} AS queued_seconds,
       j.setup_seconds, j.work_seconds,
       {total_seconds} AS total_seconds,
       j.units, j.output_uri, j.output_sha256, j.error{flagged}
FROM jobs j{join}
"""

# As 0006 made it, with the run's flagged images counted.
RUN_SUMMARY = """
CREATE VIEW run_summary AS
SELECT r.id AS run_id, r.kind, r.source, r.job_count AS jobs,
       SUM(CASE WHEN j.status = 'succeeded' THEN 1 ELSE 0 END) AS succeeded,
       SUM(CASE WHEN j.status = 'succeeded' AND j.cached THEN 1 ELSE 0 END) AS cached,
       SUM(CASE WHEN j.status IN ('pending', 'queued') THEN 1 ELSE 0 END) AS waiting,
       SUM(CASE WHEN j.status = 'running' THEN 1 ELSE 0 END) AS running,
       SUM(CASE WHEN j.status = 'failed' THEN 1 ELSE 0 END) AS failed,
       SUM(CASE WHEN j.status = 'dead' THEN 1 ELSE 0 END) AS dead,
       SUM(CASE WHEN j.status = 'cancelled' THEN 1 ELSE 0 END) AS cancelled,{flagged}
       r.created_at, MIN(j.started_at) AS first_started, r.finished_at,
       {seconds} AS seconds,
       ROUND(SUM(CASE WHEN j.status = 'succeeded' THEN 1 ELSE 0 END) / NULLIF({seconds}, 0), 3)
           AS jobs_per_second
FROM runs r
LEFT JOIN jobs j ON j.run_id = r.id{join}
GROUP BY r.id, r.kind, r.source, r.job_count, r.created_at, r.finished_at
"""
GENERATIONS = "\nLEFT JOIN generations g ON g.job_id = j.id"
FLAGGED_COUNT = "\n       SUM(CASE WHEN g.flagged THEN 1 ELSE 0 END) AS flagged,"


def upgrade() -> None:
    op.add_column(
        "generations",
        sa.Column("flagged", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    _replace_views(flagged=True)


def downgrade() -> None:
    _replace_views(flagged=False)
    op.drop_column("generations", "flagged")


def _replace_views(*, flagged: bool) -> None:
    op.execute("DROP VIEW run_summary")
    op.execute("DROP VIEW job_history")
    seconds = SECONDS[op.get_bind().dialect.name]
    join = GENERATIONS if flagged else ""
    op.execute(
        JOB_HISTORY.format(
            queued_seconds=seconds.format(start="j.enqueued_at", end="j.started_at"),
            total_seconds=seconds.format(start="j.created_at", end="j.finished_at"),
            flagged=", g.flagged" if flagged else "",
            join=join,
        )
    )
    op.execute(
        RUN_SUMMARY.format(
            seconds=seconds.format(
                start="r.created_at", end="COALESCE(r.finished_at, MAX(j.finished_at))"
            ),
            flagged="\n       SUM(CASE WHEN g.flagged THEN 1 ELSE 0 END) AS flagged,"
            if flagged
            else "",
            join=join,
        )
    )
