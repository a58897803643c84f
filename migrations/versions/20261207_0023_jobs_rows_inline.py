"""A jobs row of up to about 4 KB is kept whole in its page.

Postgres compresses a row's largest values, then moves them to the table's TOAST
relation, once the row passes `toast_tuple_target` (2032 bytes by default). A batch line
with a short completion finishes at about 2 KB (its response, its events, usage and
statistics), so its result write paid for a compression attempt and wrote the events to
the TOAST table and its index as well: in B2 (10,000 one-token lines) 730 bytes a line
went to the TOAST relation. Past 2032 bytes Postgres still starts toasting, but stops as
soon as the row is within the target: at 4080 (the most that lets two rows share an 8 KB
page) such rows are left whole; larger ones are compressed and moved as before. Rows
already written keep their layout until they are next updated.

Revision ID: 20261207_0023
Revises: 20261205_0022
Create Date: 2026-12-07 09:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "20261207_0023"
down_revision: str | None = "20261205_0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # app/models.py's TOAST_TUPLE_TARGET, as of this revision.
    op.execute("ALTER TABLE jobs SET (toast_tuple_target = 4080)")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs RESET (toast_tuple_target)")
