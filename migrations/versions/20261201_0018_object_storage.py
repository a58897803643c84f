"""Batches in object storage: where a batch's input came from and where its output goes.

`input_url`: the s3:// object its lines were read from (its input file holds them now).
`output_url` / `output_format`: where the output is exported when the batch ends, as
OpenAI JSONL (`jsonl`) or llm-engine's JSON array (`json_array`). `exported_at` /
`export_error`: how the export ended; `export_lease_until`: a worker is exporting it.
`client_request`: what an llm-engine client sent beside the lines (model_config,
priority), given back on its job object. An index finds the batches still to export.

Revision ID: 20261201_0018
Revises: 20261201_0015
Create Date: 2026-12-01 12:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "20261201_0018"
down_revision: str | None = "20261201_0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batches", sa.Column("input_url", sa.Text(), nullable=True))
    op.add_column("batches", sa.Column("output_url", sa.Text(), nullable=True))
    op.add_column("batches", sa.Column("output_format", sa.String(16), nullable=True))
    op.add_column("batches", sa.Column("exported_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("batches", sa.Column("export_error", sa.JSON(), nullable=True))
    op.add_column("batches", sa.Column("export_lease_until", sa.DateTime(timezone=True), nullable=True))
    op.add_column("batches", sa.Column("client_request", sa.JSON(), nullable=True))
    op.create_index(
        "ix_batches_export_due",
        "batches",
        ["id"],
        postgresql_where=sa.text("output_url IS NOT NULL AND exported_at IS NULL AND export_error IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_batches_export_due", table_name="batches")
    for column in (
        "client_request",
        "export_lease_until",
        "export_error",
        "exported_at",
        "output_format",
        "output_url",
        "input_url",
    ):
        op.drop_column("batches", column)
