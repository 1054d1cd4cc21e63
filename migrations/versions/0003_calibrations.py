"""calibrations and calibration_points (`canvasq calibrate`, routing of `--decoder auto`)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 07:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_path", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("hardware", sa.String(length=200), nullable=True),
        sa.Column("commit", sa.String(length=64), nullable=True),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("seeds", sa.JSON(), nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibrations")),
    )
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_calibrations_fingerprint"), ["fingerprint"], unique=False)
    op.create_table(
        "calibration_points",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("calibration_id", sa.Integer(), nullable=False),
        sa.Column("family", sa.String(length=32), nullable=False),
        sa.Column("task", sa.String(length=32), nullable=False),
        sa.Column("decoder", sa.String(length=32), nullable=False),
        sa.Column("knobs", sa.JSON(), nullable=False),
        sa.Column("label", sa.String(length=200), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("accuracy", sa.Float(), nullable=False),
        sa.Column("tok_s", sa.Float(), nullable=False),
        sa.Column("fwd_per_req", sa.Float(), nullable=False),
        sa.Column("tau", sa.Float(), nullable=False),
        sa.Column("g_over_tau", sa.Float(), nullable=False),
        sa.Column("frontier", sa.Boolean(), nullable=False),
        sa.Column("reference", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["calibration_id"],
            ["calibrations.id"],
            name=op.f("fk_calibration_points_calibration_id_calibrations"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibration_points")),
    )
    with op.batch_alter_table("calibration_points", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_calibration_points_calibration_id"), ["calibration_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("calibration_points", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calibration_points_calibration_id"))
    op.drop_table("calibration_points")
    with op.batch_alter_table("calibrations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_calibrations_fingerprint"))
    op.drop_table("calibrations")
