"""samples.origin_id: a dataset made of another's samples (`sdq dataset filter`) keeps a
row per sample, pointing at the sample that downloaded it, whose image and scores it
shares; sample_quality reads those scores through it

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-24 15:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from sdq.migrations.sqlite import views_set_aside

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FOREIGN_KEY = "fk_samples_origin_id_samples"

# As 0017 made it, with a sample's scores found through the sample it stands for, and the
# CLIP model that scored them (whose embeddings dedup reads).
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
    s.reason AS reason,
    q.model_revision AS model_revision
FROM samples s
JOIN datasets d ON d.id = s.dataset_id
LEFT JOIN sample_scores q
    ON q.id = (SELECT max(latest.id) FROM sample_scores latest
               WHERE latest.sample_id = {scored})
"""

SAMPLE_QUALITY_0017 = SAMPLE_QUALITY.replace(
    ",\n    q.model_revision AS model_revision", ""
).format(scored="s.id")


def upgrade() -> None:
    op.execute("DROP VIEW sample_quality")
    if op.get_bind().dialect.name == "sqlite":
        with views_set_aside("samples"), op.batch_alter_table("samples") as batch:
            batch.add_column(sa.Column("origin_id", sa.Integer(), nullable=True))
            batch.create_foreign_key(
                FOREIGN_KEY, "samples", ["origin_id"], ["id"], ondelete="CASCADE"
            )
    else:
        op.add_column("samples", sa.Column("origin_id", sa.BigInteger(), nullable=True))
        op.create_foreign_key(
            FOREIGN_KEY, "samples", "samples", ["origin_id"], ["id"], ondelete="CASCADE"
        )
    op.create_index("ix_samples_origin_id", "samples", ["origin_id"])
    op.execute(SAMPLE_QUALITY.format(scored="COALESCE(s.origin_id, s.id)"))


def downgrade() -> None:
    op.execute("DROP VIEW sample_quality")
    op.drop_index("ix_samples_origin_id", table_name="samples")
    if op.get_bind().dialect.name == "sqlite":
        with views_set_aside("samples"), op.batch_alter_table("samples") as batch:
            batch.drop_constraint(FOREIGN_KEY, type_="foreignkey")
            batch.drop_column("origin_id")
    else:
        op.drop_constraint(FOREIGN_KEY, "samples", type_="foreignkey")
        op.drop_column("samples", "origin_id")
    op.execute(SAMPLE_QUALITY_0017)
