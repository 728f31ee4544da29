"""checkpoint_scores: each metric's value for each model an evaluate job scored (a train
run's checkpoint, or any model), with what scored it

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26 23:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "checkpoint_scores",
        sa.Column("id", Id, nullable=False),
        sa.Column("job_id", Id, nullable=False),
        sa.Column("run_id", Id, nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("model_name", sa.Text(), nullable=False),
        sa.Column("model_revision", sa.String(length=64), nullable=False),
        sa.Column("spec_hash", sa.String(length=64), nullable=False),
        sa.Column("metric", sa.String(length=32), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column(
            "scorers",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "scored_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("CURRENT_TIMESTAMP"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"],
            name=op.f("fk_checkpoint_scores_job_id_jobs"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"],
            name=op.f("fk_checkpoint_scores_run_id_runs"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoint_scores")),
        sa.UniqueConstraint("job_id", "metric", name="uq_checkpoint_scores_job_id_metric"),
    )  # fmt: skip
    op.create_index("ix_checkpoint_scores_run_id_step", "checkpoint_scores", ["run_id", "step"])
    op.create_index("ix_checkpoint_scores_spec_hash", "checkpoint_scores", ["spec_hash"])


def downgrade() -> None:
    op.drop_index("ix_checkpoint_scores_spec_hash", table_name="checkpoint_scores")
    op.drop_index("ix_checkpoint_scores_run_id_step", table_name="checkpoint_scores")
    op.drop_table("checkpoint_scores")
