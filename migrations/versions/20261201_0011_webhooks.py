"""Webhooks: endpoints per tenant (URL, event types, signing secret) and the outbox of
deliveries (one row per event and endpoint, written with the state change that caused it).

Revision ID: 20261201_0011
Revises: 20261201_0013
Create Date: 2026-12-01 08:55:07.691678
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '20261201_0011'
down_revision: str | None = '20261201_0013'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('webhook_endpoints',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('tenant_id', sa.String(length=64), nullable=False),
    sa.Column('url', sa.Text(), nullable=False),
    sa.Column('name', sa.String(length=256), server_default='', nullable=False),
    sa.Column('event_types', postgresql.ARRAY(sa.String(length=64)), nullable=False),
    sa.Column('secret', sa.String(length=128), nullable=False),
    sa.Column('previous_secret', sa.String(length=128), nullable=True),
    sa.Column('previous_secret_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_webhook_endpoints_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_webhook_endpoints'))
    )
    op.create_index('ix_webhook_endpoints_tenant_id_id', 'webhook_endpoints', ['tenant_id', 'id'], unique=False)
    op.create_table('webhook_deliveries',
    sa.Column('endpoint_id', sa.String(length=40), nullable=False),
    sa.Column('event_id', sa.String(length=40), nullable=False),
    sa.Column('type', sa.String(length=64), nullable=False),
    sa.Column('subject_id', sa.String(length=40), nullable=False),
    sa.Column('status', sa.String(length=16), server_default='pending', nullable=False),
    sa.Column('attempts', sa.Integer(), server_default='0', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('last_status_code', sa.Integer(), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('delivered_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('pending','delivered','failed')", name=op.f('ck_webhook_deliveries_status_valid')),
    sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], name=op.f('fk_webhook_deliveries_endpoint_id_webhook_endpoints'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('endpoint_id', 'event_id', name=op.f('pk_webhook_deliveries'))
    )
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['next_attempt_at'], unique=False, postgresql_where=sa.text("status = 'pending'"))


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries', postgresql_where=sa.text("status = 'pending'"))
    op.drop_table('webhook_deliveries')
    op.drop_index('ix_webhook_endpoints_tenant_id_id', table_name='webhook_endpoints')
    op.drop_table('webhook_endpoints')
