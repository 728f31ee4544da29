"""the deployment's store, as `sdq db upgrade` last recorded it: a process that would write
its outputs elsewhere is refused at start

Revision ID: 0030
Revises: 0029
Create Date: 2026-11-29 16:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0030"
down_revision: str | None = "0029"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deployment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("store_uri", sa.Text(), nullable=False),
        sa.Column("set_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment")),
    )


def downgrade() -> None:
    op.drop_table("deployment")
