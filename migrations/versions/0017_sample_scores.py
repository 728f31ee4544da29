"""sample_scores: each kept sample's CLIP, aesthetic and NSFW scores (the curate kind), and
the view sample_quality: every sample with its latest scores and its fate

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-24 12:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Id = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

# A sample's latest scores (the newest curate run's), beside what became of it.
SAMPLE_QUALITY = """
CREATE VIEW sample_quality AS
SELECT
    s.id AS sample_id,
    d.name AS dataset,
    s.key AS key,
    s.url AS url,
    s.caption AS caption,
    q.clip_score AS clip_score,
    q.aesthetic AS aesthetic,
    q.nsfw AS nsfw,
    s.status = 'success' AS kept,
    s.reason AS reason
FROM samples s
JOIN datasets d ON d.id = s.dataset_id
LEFT JOIN sample_scores q
    ON q.id = (SELECT max(latest.id) FROM sample_scores latest WHERE latest.sample_id = s.id)
"""


def upgrade() -> None:
    op.create_table(
        "sample_scores",
        sa.Column("id", Id, nullable=False),
        sa.Column("sample_id", Id, nullable=False),
        sa.Column("dataset_id", Id, nullable=False),
        sa.Column("model_revision", sa.String(length=64), nullable=False),
        sa.Column("scorer", sa.String(length=64), nullable=False),
        sa.Column("clip_score", sa.Float(), nullable=False),
        sa.Column("aesthetic", sa.Float(), nullable=True),
        sa.Column("nsfw", sa.Float(), nullable=True),
        sa.Column("scored_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sample_id"], ["samples.id"],
            name=op.f("fk_sample_scores_sample_id_samples"), ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["dataset_id"], ["datasets.id"],
            name=op.f("fk_sample_scores_dataset_id_datasets"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sample_scores")),
        sa.UniqueConstraint("sample_id", "scorer", name="uq_sample_scores_sample_id_scorer"),
    )  # fmt: skip
    op.create_index("ix_sample_scores_dataset_id", "sample_scores", ["dataset_id"])
    op.execute(SAMPLE_QUALITY)


def downgrade() -> None:
    op.execute("DROP VIEW sample_quality")
    op.drop_index("ix_sample_scores_dataset_id", table_name="sample_scores")
    op.drop_table("sample_scores")
