"""initial schema: runs, chunks, requests, outputs, forward_traces, workers

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 23:20:33.089333
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('idempotency_key', sa.String(length=200), nullable=True),
    sa.Column('model', sa.String(length=500), nullable=False),
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('decoder', sa.String(length=32), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('input_path', sa.Text(), nullable=True),
    sa.Column('input_sha256', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.Column('started_at', sa.DateTime(), nullable=True),
    sa.Column('finished_at', sa.DateTime(), nullable=True),
    sa.Column('deadline_at', sa.DateTime(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs')),
    sa.UniqueConstraint('idempotency_key', name=op.f('uq_runs_idempotency_key'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_status'), ['status'], unique=False)

    op.create_table('workers',
    sa.Column('id', sa.String(length=200), nullable=False),
    sa.Column('host', sa.String(length=200), nullable=False),
    sa.Column('pid', sa.Integer(), nullable=False),
    sa.Column('device', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=500), nullable=False),
    sa.Column('queue', sa.String(length=200), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('heartbeat_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_workers'))
    )
    op.create_table('chunks',
    sa.Column('id', sa.String(length=48), nullable=False),
    sa.Column('run_id', sa.String(length=32), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('lease_expires_at', sa.DateTime(), nullable=True),
    sa.Column('published_at', sa.DateTime(), nullable=True),
    sa.Column('worker_id', sa.String(length=200), nullable=True),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_chunks_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_chunks')),
    sa.UniqueConstraint('run_id', 'seq', name=op.f('uq_chunks_run_id_seq'))
    )
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_chunks_run_id'), ['run_id'], unique=False)

    op.create_table('requests',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=32), nullable=False),
    sa.Column('custom_id', sa.String(length=200), nullable=False),
    sa.Column('line_no', sa.Integer(), nullable=False),
    sa.Column('prompt', sa.Text(), nullable=False),
    sa.Column('task', sa.String(length=16), nullable=True),
    sa.Column('max_tokens', sa.Integer(), nullable=False),
    sa.Column('decoder', sa.String(length=32), nullable=True),
    sa.Column('chunk_id', sa.String(length=48), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['chunk_id'], ['chunks.id'], name=op.f('fk_requests_chunk_id_chunks'), ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_requests_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_requests')),
    sa.UniqueConstraint('run_id', 'custom_id', name=op.f('uq_requests_run_id_custom_id'))
    )
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_requests_chunk_id'), ['chunk_id'], unique=False)
        batch_op.create_index('ix_requests_run_id_status', ['run_id', 'status'], unique=False)

    op.create_table('forward_traces',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=32), nullable=False),
    sa.Column('custom_id', sa.String(length=200), nullable=False),
    sa.Column('forward_index', sa.Integer(), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.Column('commits', sa.Integer(), nullable=False),
    sa.Column('canvases', sa.Integer(), nullable=False),
    sa.Column('states', sa.String(length=200), nullable=False),
    sa.Column('ms', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('own_rows', sa.Integer(), nullable=True),
    sa.Column('own_commits', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['run_id', 'custom_id'], ['requests.run_id', 'requests.custom_id'], name=op.f('fk_forward_traces_run_id_custom_id_requests'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_forward_traces')),
    sa.UniqueConstraint('run_id', 'custom_id', 'forward_index', name=op.f('uq_forward_traces_run_id_custom_id_forward_index'))
    )
    op.create_table('outputs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=32), nullable=False),
    sa.Column('custom_id', sa.String(length=200), nullable=False),
    sa.Column('text', sa.Text(), nullable=True),
    sa.Column('token_ids', sa.JSON(), nullable=True),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('forwards', sa.Integer(), nullable=False),
    sa.Column('decoder', sa.String(length=32), nullable=True),
    sa.Column('gen_ms', sa.Float(), nullable=False),
    sa.Column('worker_id', sa.String(length=200), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('updated_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['run_id', 'custom_id'], ['requests.run_id', 'requests.custom_id'], name=op.f('fk_outputs_run_id_custom_id_requests'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outputs')),
    sa.UniqueConstraint('run_id', 'custom_id', name=op.f('uq_outputs_run_id_custom_id'))
    )
    with op.batch_alter_table('outputs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_outputs_worker_id'), ['worker_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('outputs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_outputs_worker_id'))

    op.drop_table('outputs')
    op.drop_table('forward_traces')
    with op.batch_alter_table('requests', schema=None) as batch_op:
        batch_op.drop_index('ix_requests_run_id_status')
        batch_op.drop_index(batch_op.f('ix_requests_chunk_id'))

    op.drop_table('requests')
    with op.batch_alter_table('chunks', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_chunks_run_id'))

    op.drop_table('chunks')
    op.drop_table('workers')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_status'))

    op.drop_table('runs')
