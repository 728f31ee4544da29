"""encode: latent shards, and each image shard"s file hash

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 18:23:05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "latent_shards",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column(
            "dataset_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False
        ),
        sa.Column("shard_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("image_sha256", sa.String(length=64), nullable=False),
        sa.Column("model_name", sa.Text(), nullable=False),
        sa.Column("model_revision", sa.String(length=64), nullable=False),
        sa.Column("resolution", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column(
            "tensors",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("seconds", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["dataset_id"],
            ["datasets.id"],
            name=op.f("fk_latent_shards_dataset_id_datasets"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["shard_id"],
            ["shards.id"],
            name=op.f("fk_latent_shards_shard_id_shards"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_latent_shards")),
        sa.UniqueConstraint(
            "shard_id", "model_revision", "resolution", name="uq_latent_shards_shard_id_model"
        ),
    )
    op.create_index("ix_latent_shards_dataset_id", "latent_shards", ["dataset_id"])
    op.add_column("shards", sa.Column("sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("shards", "sha256")
    op.drop_index("ix_latent_shards_dataset_id", table_name="latent_shards")
    op.drop_table("latent_shards")
