"""requests.think (a constrained row that writes free text before its document: a line's
`reasoning_effort` low / medium / high), outputs.reasoning and outputs.reasoning_tokens (that text and
how many of its completion tokens it took; null and 0 otherwise)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 15:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:  # plain ALTERs: a batch table copy on SQLite would break the run_throughput view
    op.add_column("requests", sa.Column("think", sa.Boolean(), nullable=False, server_default=sa.false()))
    op.add_column("outputs", sa.Column("reasoning", sa.Text(), nullable=True))
    op.add_column("outputs", sa.Column("reasoning_tokens", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("outputs", "reasoning_tokens")
    op.drop_column("outputs", "reasoning")
    op.drop_column("requests", "think")
