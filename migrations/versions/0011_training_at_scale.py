"""training at scale: checkpoints that hold the training state only (no model), their
state hash and deletion mark; each step's world size and MFU; the gangs of nodes that run
a job over several machines; lineage through the runs a run started from; a model's
encoders' hash

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-23 17:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON_FIELD = {
    "postgresql": "{column} ->> '{field}'",
    "sqlite": "json_extract({column}, '$.{field}')",
}

# Every train run with itself and each run it went on from (`sdq train --resume-from`),
# however far back: the weights of a run's checkpoint learned from all of their inputs.
TRAIN_LINEAGE = """
CREATE VIEW train_lineage AS
WITH RECURSIVE lineage(run_id, ancestor_run_id, depth) AS (
    SELECT id, id, 0 FROM runs WHERE kind = 'train'
    UNION ALL
    SELECT l.run_id, CAST({start_run} AS BIGINT), l.depth + 1
    FROM lineage l JOIN runs r ON r.id = l.ancestor_run_id
    WHERE {start_run} IS NOT NULL
)
SELECT run_id, ancestor_run_id, depth FROM lineage
"""

# The whole chain behind a generated image: the checkpoint whose model made it, its train
# run and the runs that one went on from, the latent shards each read, their image shards
# and the samples (URLs, captions).
IMAGE_SOURCES = """
CREATE VIEW image_sources AS
SELECT j.id AS job_id, c.run_id AS train_run_id, c.step, c.model_revision,
       t.ancestor_run_id AS input_run_id,
       l.uri AS latent_shard, h.uri AS image_shard, s.key, s.url, s.caption
FROM jobs j
JOIN checkpoints c ON c.model_revision = {model_revision}
JOIN train_lineage t ON t.run_id = c.run_id
JOIN train_inputs i ON i.run_id = t.ancestor_run_id
JOIN latent_shards l ON l.id = i.latent_shard_id
JOIN shards h ON h.id = l.shard_id
JOIN samples s ON s.shard_id = l.shard_id AND s.status = 'success'
WHERE j.kind = 'generate'
"""

# As migration 0005 made it.
IMAGE_SOURCES_0005 = """
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


def _field(column: str, field: str) -> str:
    return JSON_FIELD[op.get_bind().dialect.name].format(column=column, field=field)


def upgrade() -> None:
    # SQLite rebuilds a table to change a column; a view naming it must not exist meanwhile.
    op.execute("DROP VIEW image_sources")
    with op.batch_alter_table("checkpoints") as batch:
        batch.alter_column("model_prefix", existing_type=sa.Text(), nullable=True)
        batch.alter_column("model_revision", existing_type=sa.String(64), nullable=True)
        batch.add_column(sa.Column("state_sha256", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("train_steps") as batch:
        batch.add_column(sa.Column("world_size", sa.Integer(), server_default="1", nullable=False))
        batch.add_column(sa.Column("mfu", sa.Float(), nullable=True))
    op.create_table(
        "train_gangs",
        sa.Column("job_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("node", sa.Integer(), nullable=False),
        sa.Column("worker", sa.Text(), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column(
            "joined_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("CURRENT_TIMESTAMP"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_train_gangs_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "attempt", "node", name=op.f("pk_train_gangs")),
    )
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("encoders_hash", sa.String(length=64), nullable=True))
    op.execute(TRAIN_LINEAGE.format(start_run=_field("r.options", "start_run")))
    op.execute(IMAGE_SOURCES.format(model_revision=_field("j.spec", "model_revision")))


def downgrade() -> None:
    op.execute("DROP VIEW image_sources")
    op.execute("DROP VIEW train_lineage")
    op.drop_table("train_gangs")
    with op.batch_alter_table("models") as batch:
        batch.drop_column("encoders_hash")
    with op.batch_alter_table("train_steps") as batch:
        batch.drop_column("mfu")
        batch.drop_column("world_size")
    op.execute("DELETE FROM checkpoints WHERE model_prefix IS NULL")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("deleted_at")
        batch.drop_column("state_sha256")
        batch.alter_column("model_revision", existing_type=sa.String(64), nullable=False)
        batch.alter_column("model_prefix", existing_type=sa.Text(), nullable=False)
    op.execute(IMAGE_SOURCES_0005.format(model_revision=_field("j.spec", "model_revision")))
