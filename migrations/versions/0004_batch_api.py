"""api_keys, api_files, api_batches (`canvasq serve`: the OpenAI Files and Batches API)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 07:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("project", sa.String(length=200), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_project"), ["project"], unique=False)
    op.create_table(
        "api_files",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project", sa.String(length=200), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("lines", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("path", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_api_files")),
        sa.UniqueConstraint("id", name=op.f("uq_api_files_id")),
    )
    with op.batch_alter_table("api_files", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_files_project"), ["project"], unique=False)
    op.create_table(
        "api_batches",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("project", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=True),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("meta", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("expires_at", sa.DateTime(), nullable=True),
        sa.Column("failed_at", sa.DateTime(), nullable=True),
        sa.Column("cancelling_at", sa.DateTime(), nullable=True),
        sa.Column("finalizing_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_api_batches_run_id_runs"),
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_api_batches")),
        sa.UniqueConstraint("id", name=op.f("uq_api_batches_id")),
    )
    with op.batch_alter_table("api_batches", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_batches_project"), ["project"], unique=False)
        batch_op.create_index(batch_op.f("ix_api_batches_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("api_batches", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_batches_run_id"))
        batch_op.drop_index(batch_op.f("ix_api_batches_project"))
    op.drop_table("api_batches")
    with op.batch_alter_table("api_files", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_files_project"))
    op.drop_table("api_files")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_project"))
    op.drop_table("api_keys")
