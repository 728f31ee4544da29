"""train: inputs, steps and checkpoints of train runs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 18:58:39
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("model_prefix", sa.Text(), nullable=False),
        sa.Column("model_revision", sa.String(length=64), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("CURRENT_TIMESTAMP"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
    )
    op.create_index(
        "ix_checkpoints_model_revision", "checkpoints", ["model_revision"], unique=False
    )
    op.create_table(
        "train_steps",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=False),
        sa.Column("lr", sa.Float(), nullable=False),
        sa.Column("samples_per_second", sa.Float(), nullable=False),
        sa.Column(
            "at",
            sa.DateTime(timezone=True),
            server_default=sa.text("CURRENT_TIMESTAMP"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_train_steps_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "step", name=op.f("pk_train_steps")),
    )
    op.create_table(
        "train_inputs",
        sa.Column("run_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "latent_shard_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.ForeignKeyConstraint(
            ["latent_shard_id"],
            ["latent_shards.id"],
            name=op.f("fk_train_inputs_latent_shard_id_latent_shards"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_train_inputs_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "latent_shard_id", name=op.f("pk_train_inputs")),
    )
    model_revision = {
        "postgresql": "j.spec ->> 'model_revision'",
        "sqlite": "json_extract(j.spec, '$.model_revision')",
    }[op.get_bind().dialect.name]
    op.execute(IMAGE_SOURCES.format(model_revision=model_revision))


# The whole chain behind a generated image: the checkpoint whose model made it, the train
# run, the latent shards it read, their image shards, and the samples (URLs, captions).
IMAGE_SOURCES = """
CREATE VIEW image_sources AS
SELECT j.id AS job_id, c.run_id AS train_run_id, c.step, c.model_revision,
       l.uri AS latent_shard, h.uri AS image_shard, s.key, s.url, s.caption
FROM jobs j
JOIN checkpoints c ON c.model_revision = {model_revision}
JOIN train_inputs i ON i.run_id = c.run_id
JOIN latent_shards l ON l.id = i.latent_shard_id
JOIN shards h ON h.id = l.shard_id
JOIN samples s ON s.shard_id = l.shard_id AND s.status = 'success'
WHERE j.kind = 'generate'
"""


def downgrade() -> None:
    op.execute("DROP VIEW image_sources")
    op.drop_table("train_inputs")
    op.drop_table("train_steps")
    op.drop_index("ix_checkpoints_model_revision", table_name="checkpoints")
    op.drop_table("checkpoints")
