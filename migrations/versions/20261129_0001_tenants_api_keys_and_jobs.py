"""Tenants, hashed API keys, and jobs with their lease, epoch and per-state timestamps.

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 12:32:56.769807
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('tenants',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('name', name=op.f('uq_tenants_name'))
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), server_default='chat', nullable=False),
    sa.Column('status', sa.String(length=16), server_default='queued', nullable=False),
    sa.Column('priority', sa.Integer(), server_default='0', nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.Column('response', sa.JSON(), nullable=True),
    sa.Column('error', sa.JSON(), nullable=True),
    sa.Column('usage', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('generation_stats', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('power_usage', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('epoch', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('lease_owner', sa.String(length=256), nullable=True),
    sa.Column('finished_by', sa.String(length=256), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancel_requested_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('succeeded_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('idempotency_key', sa.String(length=256), nullable=True),
    sa.Column('request_hash', sa.String(length=64), nullable=True),
    sa.Column('batch_id', sa.String(length=40), nullable=True),
    sa.Column('custom_id', sa.Text(), nullable=True),
    sa.Column('line_no', sa.Integer(), nullable=True),
    sa.CheckConstraint("status IN ('queued','running','succeeded','failed','cancelled','expired')", name=op.f('ck_jobs_status_valid')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_jobs_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('batch_id', 'line_no', name='uq_jobs_batch_line'),
    sa.UniqueConstraint('tenant_id', 'idempotency_key', name='uq_jobs_tenant_idempotency')
    )
    op.create_index('ix_jobs_active', 'jobs', ['status', 'model'], unique=False, postgresql_where=sa.text("status IN ('queued','running')"))
    op.create_index('ix_jobs_tenant_id_id', 'jobs', ['tenant_id', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_jobs_tenant_id_id', table_name='jobs')
    op.drop_index('ix_jobs_active', table_name='jobs', postgresql_where=sa.text("status IN ('queued','running')"))
    op.drop_table('jobs')
    op.drop_table('api_keys')
    op.drop_table('tenants')
