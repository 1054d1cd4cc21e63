"""api_files.expires_at (a file past it is gone: no route finds it, the finalizer deletes it) and
api_batches.output_expires_s (a batch's `output_expires_after.seconds`, applied to its output and
error files when they are written)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 18:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_files", sa.Column("expires_at", sa.DateTime(), nullable=True))
    op.create_index("ix_api_files_expires_at", "api_files", ["expires_at"])
    op.add_column("api_batches", sa.Column("output_expires_s", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("api_batches", "output_expires_s")
    op.drop_index("ix_api_files_expires_at", table_name="api_files")
    op.drop_column("api_files", "expires_at")
