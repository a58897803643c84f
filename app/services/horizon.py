"""The transaction horizon of a statement: every transaction that commits after the
statement's snapshot has an id at or above it, so what ended below it is final. The
argument is in app/services/results.py, which releases a batch's ended lines by it;
app/services/batch_counts.py keeps a batch's settled counts by it."""

from __future__ import annotations

# CTEs ending in `horizon(h)`, for a statement that starts `WITH` + HORIZON_CTES.
HORIZON_CTES = """
    snap AS (SELECT pg_current_snapshot() AS s),
    here AS (SELECT oid FROM pg_database WHERE datname = current_database()),
    elsewhere AS (
      SELECT backend_xid::text::bigint AS x FROM pg_stat_activity
      WHERE backend_xid IS NOT NULL AND datid IS DISTINCT FROM (SELECT oid FROM here)
    ),
    horizon AS MATERIALIZED (
      SELECT least(
        pg_snapshot_xmax(snap.s)::text::bigint,
        (SELECT min(x::text::bigint) FROM pg_snapshot_xip(snap.s) AS x
         WHERE x::text::bigint % 4294967296 NOT IN (SELECT e.x FROM elsewhere e))
      ) AS h FROM snap
    )
"""
