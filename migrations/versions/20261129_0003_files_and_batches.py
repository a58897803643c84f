"""Files (input lines kept as uploaded; output files generated from job rows) and batches,
with the indexes the batch feeder reads.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 14:08:06.084817
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('batches',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=40), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_file_id', sa.String(length=40), nullable=True),
    sa.Column('error_file_id', sa.String(length=40), nullable=True),
    sa.Column('total', sa.Integer(), server_default='0', nullable=False),
    sa.Column('usage', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('parent_batch_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_batches_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches'))
    )
    op.create_index('ix_batches_active', 'batches', ['status'], unique=False, postgresql_where=sa.text("status IN ('validating','in_progress','cancelling','finalizing')"))
    op.create_index('ix_batches_tenant_id_id', 'batches', ['tenant_id', 'id'], unique=False)
    op.create_table('files',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('filename', sa.Text(), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('line_count', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('batch_id', sa.String(length=40), nullable=True),
    sa.Column('batch_part', sa.String(length=16), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_files_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_files'))
    )
    op.create_index('ix_files_tenant_id_id', 'files', ['tenant_id', 'id'], unique=False)
    op.create_table('file_lines',
    sa.Column('file_id', sa.String(length=40), nullable=False),
    sa.Column('line_no', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.Text(), nullable=False),
    sa.Column('raw', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['file_id'], ['files.id'], name=op.f('fk_file_lines_file_id_files'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('file_id', 'line_no', name=op.f('pk_file_lines'))
    )
    op.create_index('ix_jobs_dispatched', 'jobs', ['model'], unique=False, postgresql_where=sa.text("batch_id IS NOT NULL AND (status = 'running' OR (status = 'queued' AND enqueued_at IS NOT NULL))"))
    op.create_index('ix_jobs_undispatched', 'jobs', ['model', 'priority', 'batch_id', 'line_no'], unique=False, postgresql_where=sa.text("status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"))


def downgrade() -> None:
    op.drop_index('ix_jobs_undispatched', table_name='jobs', postgresql_where=sa.text("status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"))
    op.drop_index('ix_jobs_dispatched', table_name='jobs', postgresql_where=sa.text("batch_id IS NOT NULL AND (status = 'running' OR (status = 'queued' AND enqueued_at IS NOT NULL))"))
    op.drop_table('file_lines')
    op.drop_index('ix_files_tenant_id_id', table_name='files')
    op.drop_table('files')
    op.drop_index('ix_batches_tenant_id_id', table_name='batches')
    op.drop_index('ix_batches_active', table_name='batches', postgresql_where=sa.text("status IN ('validating','in_progress','cancelling','finalizing')"))
    op.drop_table('batches')
