"""kind-neutral jobs: generation's columns move to `generations`; runs say how they travel

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 10:40:00

Plain ALTERs on every backend (SQLite has dropped and renamed columns natively since
3.35): rebuilding `jobs` the batch way would drop the table and, with foreign keys on,
cascade-delete every job's history.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
JsonDocument = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
GENERATION_COLUMNS = ("prompt", "style", "model", "seed", "source_line", "batch_key")
TRGM = {"postgresql_using": "gin", "postgresql_ops": {"prompt": "gin_trgm_ops"}}
# Messages of a generate run carried batch size x calls per task jobs (8 x 4 by default).
GENERATE_JOBS_PER_MESSAGE = 32


def upgrade() -> None:
    op.create_table(
        "generations",
        sa.Column("job_id", Id, nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("style", sa.Text(), nullable=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("source_line", sa.Integer(), nullable=True),
        sa.Column("batch_key", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_generations_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_generations")),
    )
    columns = ", ".join(GENERATION_COLUMNS)
    op.execute(
        f"INSERT INTO generations (job_id, {columns}) "
        f"SELECT id, {columns} FROM jobs WHERE kind = 'generate'"
    )
    op.create_index("ix_generations_prompt_trgm", "generations", ["prompt"], **TRGM)
    op.drop_index("ix_jobs_prompt_trgm", table_name="jobs", **TRGM)
    for column in GENERATION_COLUMNS:
        op.drop_column("jobs", column)
    op.alter_column("jobs", "render_seconds", new_column_name="work_seconds")
    op.add_column(
        "runs", sa.Column("jobs_per_message", sa.Integer(), server_default="1", nullable=False)
    )
    op.add_column(
        "runs", sa.Column("task_options", JsonDocument, server_default="{}", nullable=False)
    )
    op.execute(
        f"UPDATE runs SET jobs_per_message = {GENERATE_JOBS_PER_MESSAGE} WHERE kind = 'generate'"
    )


def downgrade() -> None:
    op.drop_column("runs", "task_options")
    op.drop_column("runs", "jobs_per_message")
    op.alter_column("jobs", "work_seconds", new_column_name="render_seconds")
    # NOT NULL columns need a default to be added to a table with rows; on SQLite it stays.
    placeholders = {"prompt": "''", "model": "''", "seed": "0", "batch_key": "''"}
    types = {
        "prompt": sa.Text(),
        "style": sa.Text(),
        "model": sa.Text(),
        "seed": sa.BigInteger(),
        "source_line": sa.Integer(),
        "batch_key": sa.String(length=64),
    }
    for column in GENERATION_COLUMNS:
        default = placeholders.get(column)
        op.add_column(
            "jobs",
            sa.Column(
                column,
                types[column],
                nullable=default is None,
                server_default=sa.text(default) if default else None,
            ),
        )
        op.execute(
            f"UPDATE jobs SET {column} = (SELECT {column} FROM generations "
            "WHERE generations.job_id = jobs.id) "
            "WHERE id IN (SELECT job_id FROM generations)"
        )
        if default and op.get_bind().dialect.name == "postgresql":
            op.alter_column("jobs", column, server_default=None)
    op.create_index("ix_jobs_prompt_trgm", "jobs", ["prompt"], **TRGM)
    op.drop_index("ix_generations_prompt_trgm", table_name="generations", **TRGM)
    op.drop_table("generations")
