"""models.format: the registry holds LoRA files (`sdq model push FILE.safetensors NAME`)
beside pipeline folders, and `--model` and `--lora` each take only their own

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-24 18:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(
            sa.Column("format", sa.String(length=16), server_default="pipeline", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("format")
