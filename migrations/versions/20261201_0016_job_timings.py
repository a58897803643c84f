"""Job timings: each job's own queue wait, time to first token and end-to-end seconds.

Written by the worker with the job's result (worker/store.py), from the same figures its
`/metrics` histograms observe (worker/metrics.py), so a histogram can be checked against the
records. Rows that ended before this migration have none.

Revision ID: 20261201_0016
Revises: 20261201_0015
Create Date: 2026-12-01 12:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0016"
down_revision: str | None = "20261201_0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("queue_wait_seconds", sa.Double(), nullable=True))
    op.add_column("jobs", sa.Column("ttft_seconds", sa.Double(), nullable=True))
    op.add_column("jobs", sa.Column("e2e_seconds", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "e2e_seconds")
    op.drop_column("jobs", "ttft_seconds")
    op.drop_column("jobs", "queue_wait_seconds")
