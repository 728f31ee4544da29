"""image_sources follows an image's LoRAs too: a LoRA a train run made leads from the image
to the URLs it learned from, as a checkpoint's pipeline does

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-27 20:30:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The checkpoints an image was made by: its model's, and those of the LoRAs rendered with it
# (a LoRA run's model revision is its file's sha256, as the spec records the LoRA). A union
# of two equi-joins, where an OR of the two would leave the planner no hash or index join.
IMAGE_SOURCES = """
CREATE VIEW image_sources AS
WITH made_by(job_id, revision) AS (
    SELECT j.id, {model_revision} FROM jobs j WHERE j.kind = 'generate'
    UNION ALL
    SELECT j.id, {lora_revision} FROM jobs j {loras} WHERE j.kind = 'generate'
)
SELECT m.job_id, c.run_id AS train_run_id, c.step, c.model_revision,
       t.ancestor_run_id AS input_run_id,
       l.uri AS latent_shard, h.uri AS image_shard, s.key, s.url, s.caption
FROM made_by m
JOIN checkpoints c ON c.model_revision = m.revision
JOIN train_lineage t ON t.run_id = c.run_id
JOIN train_inputs i ON i.run_id = t.ancestor_run_id
JOIN latent_shards l ON l.id = i.latent_shard_id
JOIN shards h ON h.id = l.shard_id
JOIN samples s ON s.shard_id = l.shard_id AND s.status = 'success'
"""

# As migration 0011 made it.
IMAGE_SOURCES_0011 = """
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

MODEL_REVISION = {
    "postgresql": "j.spec ->> 'model_revision'",
    "sqlite": "json_extract(j.spec, '$.model_revision')",
}
# Each of a job's LoRAs as a row beside the job, and its sha256.
LORAS = {
    "postgresql": ("CROSS JOIN LATERAL jsonb_array_elements(j.spec -> 'loras') lora",
                   "lora ->> 'sha256'"),
    "sqlite": (", json_each(j.spec, '$.loras') lora", "json_extract(lora.value, '$.sha256')"),
}  # fmt: skip


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    loras, lora_revision = LORAS[dialect]
    op.execute("DROP VIEW image_sources")
    op.execute(IMAGE_SOURCES.format(model_revision=MODEL_REVISION[dialect], loras=loras,
                                    lora_revision=lora_revision))  # fmt: skip


def downgrade() -> None:
    op.execute("DROP VIEW image_sources")
    op.execute(IMAGE_SOURCES_0011.format(model_revision=MODEL_REVISION[op.get_bind().dialect.name]))
