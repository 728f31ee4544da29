"""latent_shards.width, height and bucketed: a latent shard holds one shape, a square at
its resolution or one aspect-ratio bucket of the area resolution x resolution
(`sdq encode --buckets`), so one image shard has a latent shard per bucket its images
went to; train_steps.bucket: the bucket a step of a run on buckets trained on

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-27 23:50:00
"""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import sqlalchemy as sa
from alembic import op
from alembic.operations import BatchOperations

from sdq.migrations.sqlite import rows_kept, views_set_aside

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNIQUE = "uq_latent_shards_shard_id_model"
BEFORE = ["shard_id", "model_revision", "resolution"]
AFTER = [*BEFORE, "bucketed", "width", "height"]


def upgrade() -> None:
    op.add_column("latent_shards", sa.Column("width", sa.Integer(), nullable=True))
    op.add_column("latent_shards", sa.Column("height", sa.Integer(), nullable=True))
    op.add_column(
        "latent_shards",
        sa.Column("bucketed", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.execute("UPDATE latent_shards SET width = resolution, height = resolution")
    with _rebuilt() as batch:
        batch.alter_column("width", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("height", existing_type=sa.Integer(), nullable=False)
        batch.drop_constraint(UNIQUE, type_="unique")
        batch.create_unique_constraint(UNIQUE, AFTER)
    op.add_column("train_steps", sa.Column("bucket", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("train_steps", "bucket")
    op.execute("DELETE FROM latent_shards WHERE bucketed")
    with _rebuilt() as batch:
        batch.drop_constraint(UNIQUE, type_="unique")
        batch.create_unique_constraint(UNIQUE, BEFORE)
        batch.drop_column("bucketed")
        batch.drop_column("height")
        batch.drop_column("width")


@contextmanager
def _rebuilt() -> Iterator[BatchOperations]:
    """latent_shards altered where SQLite rebuilds it: the views on it set aside, and the
    train runs' inputs, which reference it, kept."""
    with (
        rows_kept("train_inputs"),
        views_set_aside("latent_shards"),
        op.batch_alter_table("latent_shards") as batch,
    ):
        yield batch
