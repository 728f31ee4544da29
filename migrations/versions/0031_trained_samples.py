"""which sample each latent shard's row is, and the rows each train run held out: a run's
lineage lists the samples it trained on, no longer every sample of the image shards its
latents came from

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-29 23:00:00
"""

import importlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sdq.migrations.sqlite import rows_kept, views_set_aside

revision: str = "0031"
down_revision: str | None = "0030"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# The samples a run trained on: its latent shards' rows less those it held out. A latent
# shard encoded before its rows were recorded stands for its image shard's kept samples,
# as every latent shard did before (its held-out and too-small ones too).
RECORDED = """
JOIN latent_samples r ON r.latent_shard_id = l.id
JOIN samples s ON s.id = r.sample_id
WHERE l.rows_recorded AND NOT EXISTS (
    SELECT 1 FROM train_held_out o
    WHERE o.run_id = i.run_id AND o.latent_shard_id = l.id AND o.latent_row = r.latent_row
)"""
UNRECORDED = """
JOIN samples s ON s.shard_id = l.shard_id AND s.status = 'success'
WHERE NOT l.rows_recorded"""

TRAIN_SAMPLES = """
SELECT i.run_id, i.latent_shard_id, s.id AS sample_id
FROM train_inputs i
JOIN latent_shards l ON l.id = i.latent_shard_id
{samples}"""

# As migration 0025 made it, but through the samples each run trained on. Each branch is
# the whole chain: a condition on the job (or the run) reaches into both, where a join to
# a union reads every latent sample (Postgres, one image whose run read 10 of 200 latent
# shards of 1,000 samples: 150 ms, against 48).
IMAGE_SOURCES = """
SELECT m.job_id, c.run_id AS train_run_id, c.step, c.model_revision,
       t.ancestor_run_id AS input_run_id,
       l.uri AS latent_shard, h.uri AS image_shard, s.key, s.url, s.caption
FROM (
    SELECT j.id AS job_id, {model_revision} AS revision FROM jobs j WHERE j.kind = 'generate'
    UNION ALL
    SELECT j.id, {lora_revision} FROM jobs j {loras} WHERE j.kind = 'generate'
) m
JOIN checkpoints c ON c.model_revision = m.revision
JOIN train_lineage t ON t.run_id = c.run_id
JOIN train_inputs i ON i.run_id = t.ancestor_run_id
JOIN latent_shards l ON l.id = i.latent_shard_id
JOIN shards h ON h.id = l.shard_id
{samples}"""


# Migration files are named from their revision, which no import statement can spell.
BEFORE = importlib.import_module("sdq.migrations.versions.0025_lora_image_sources")


def upgrade() -> None:
    op.add_column(
        "latent_shards",
        sa.Column("rows_recorded", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.create_table(
        "latent_samples",
        sa.Column("latent_shard_id", ID, nullable=False),
        sa.Column("latent_row", sa.Integer(), nullable=False),
        sa.Column("sample_id", ID, nullable=False),
        sa.ForeignKeyConstraint(
            ["latent_shard_id"],
            ["latent_shards.id"],
            name=op.f("fk_latent_samples_latent_shard_id_latent_shards"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["sample_id"],
            ["samples.id"],
            name=op.f("fk_latent_samples_sample_id_samples"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("latent_shard_id", "latent_row", name=op.f("pk_latent_samples")),
    )
    op.create_index("ix_latent_samples_sample_id", "latent_samples", ["sample_id"])
    op.create_table(
        "train_held_out",
        sa.Column("run_id", ID, nullable=False),
        sa.Column("latent_shard_id", ID, nullable=False),
        sa.Column("latent_row", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["latent_shard_id"],
            ["latent_shards.id"],
            name=op.f("fk_train_held_out_latent_shard_id_latent_shards"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_train_held_out_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "latent_shard_id", "latent_row", name=op.f("pk_train_held_out")
        ),
    )
    op.create_index("ix_train_held_out_latent_shard_id", "train_held_out", ["latent_shard_id"])
    op.execute("DROP VIEW image_sources")
    op.execute(_view("train_samples", TRAIN_SAMPLES))
    op.execute(_image_sources(_view("image_sources", IMAGE_SOURCES)))


def downgrade() -> None:
    op.execute("DROP VIEW image_sources")
    op.execute("DROP VIEW train_samples")
    op.drop_index("ix_train_held_out_latent_shard_id", table_name="train_held_out")
    op.drop_table("train_held_out")
    op.drop_index("ix_latent_samples_sample_id", table_name="latent_samples")
    op.drop_table("latent_samples")
    # SQLite drops a column by rebuilding the table: the views on it set aside, and the
    # train runs' inputs, which reference it, kept.
    with (
        rows_kept("train_inputs"),
        views_set_aside("latent_shards"),
        op.batch_alter_table("latent_shards") as table,
    ):
        table.drop_column("rows_recorded")
    op.execute(_image_sources(BEFORE.IMAGE_SOURCES))


def _view(name: str, chain: str) -> str:
    """The view of `chain` through the samples of latent shards with rows recorded, and
    through those of the image shards of the latent shards without."""
    both = (chain.replace("{samples}", samples) for samples in (RECORDED, UNRECORDED))
    return f"CREATE VIEW {name} AS" + "\nUNION ALL".join(both)


def _image_sources(definition: str) -> str:
    dialect = op.get_bind().dialect.name
    loras, lora_revision = BEFORE.LORAS[dialect]
    return definition.format(model_revision=BEFORE.MODEL_REVISION[dialect], loras=loras,
                             lora_revision=lora_revision)  # fmt: skip
