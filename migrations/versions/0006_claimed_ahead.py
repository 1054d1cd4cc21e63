"""chunks.claimed_ahead: the chunk was claimed from SQL by a worker whose decode slots were running
dry, before its message arrived; that message, when it comes, is dropped without counting as a
delivery while the claim holds (or once the chunk is done)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 22:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("chunks", sa.Column("claimed_ahead", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    # Plain DROP COLUMN (SQLite >= 3.35), not a batch copy of `chunks` (its rows are referenced).
    op.drop_column("chunks", "claimed_ahead")
