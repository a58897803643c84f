"""Request ids: the HTTP request that created a job (or a batch, whose lines carry it too).

`jobs.request_id` and `batches.request_id` hold the `X-Request-ID` of the request that
created the row (app/request_ids.py); rows made before this migration have none.

Revision ID: 20261201_0015
Revises: 20261201_0012
Create Date: 2026-12-01 10:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0015"
down_revision: str | None = "20261201_0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("request_id", sa.String(128), nullable=True))
    op.add_column("batches", sa.Column("request_id", sa.String(128), nullable=True))


def downgrade() -> None:
    op.drop_column("batches", "request_id")
    op.drop_column("jobs", "request_id")
