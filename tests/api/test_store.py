"""The worker's job store against real Postgres: claims, the epoch fence, bulk results."""

from __future__ import annotations

import time

import psycopg
from sqlalchemy import text

from tests.helpers import queued, response
from worker.store import JobStore, Result


def test_bulk_results_keep_nul_characters_and_respect_the_fence(services) -> None:
    store = JobStore(services.db)
    ids = queued(services, 3)
    claims = store.claim_many(ids, "w1", 30, 3)
    assert [c.job_id for c in claims] == ids and all(c.epoch == 1 for c in claims)
    assert store.claim_many(ids, "w2", 30, 3) == []  # live leases: nobody else
    with services.db.session() as s:  # someone took the third over
        s.execute(text("UPDATE jobs SET epoch = epoch + 1 WHERE id = :i"), {"i": ids[2]})
    results = [
        Result(
            ids[0],
            1,
            "succeeded",
            response=response("a\u0000b"),
            usage={"completion_tokens": 1},
            events=[{"id": "1-1", "type": "chunk", "data": {"x": "\u0000"}}],
        ),
        Result(ids[1], 1, "failed", error={"error": {"message": "no", "type": "invalid_request_error"}}),
        Result(ids[2], 1, "succeeded", response=response("stale")),
    ]
    assert store.finish_many(results) == {ids[0], ids[1]}
    with services.db.session() as s:
        rows = {
            r.id: r
            for r in s.execute(
                text("SELECT id, status, response, events, finished_by FROM jobs WHERE id = ANY(:i)"),
                {"i": ids},
            )
        }
    assert rows[ids[0]].response["choices"][0]["message"]["content"] == "a\u0000b"
    assert rows[ids[0]].events[0]["data"]["x"] == "\u0000" and rows[ids[0]].finished_by == "w1"
    assert rows[ids[1]].status == "failed"
    assert rows[ids[2]].status == "running" and rows[ids[2]].response is None


def test_hand_back_requeues_without_a_message(services) -> None:
    store = JobStore(services.db)
    (job_id,) = queued(services, 1)
    (claim,) = store.claim_many([job_id], "w1", 30, 3)
    assert store.finish_many([Result(job_id, claim.epoch, "queued")]) == {job_id}
    with services.db.session() as s:
        row = s.execute(
            text("SELECT status, enqueued_at, lease_owner, attempts FROM jobs WHERE id = :i"), {"i": job_id}
        ).one()
    assert (
        row.status == "queued" and row.enqueued_at is None and row.lease_owner is None and row.attempts == 1
    )


def test_lease_renewal_passes_over_a_row_being_written_and_still_reports_it(services, stores) -> None:
    """Waiting for a row another statement holds, while holding the rest, could deadlock
    with it (a result being saved locks its rows in an order of its own)."""
    store = JobStore(services.db)
    ids = sorted(queued(services, 3))
    owner = f"w-{ids[0]}"
    claims = store.claim_many(ids, owner, 30, 3)
    with psycopg.connect(stores.database_url) as other:
        other.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (ids[1],))
        started = time.monotonic()
        owned = store.extend_leases(owner, 600)
        assert time.monotonic() - started < 1  # did not wait for the lock
        other.rollback()
    assert owned == {c.job_id: (c.epoch, False) for c in claims}
    with services.db.session() as s:
        left = dict(
            s.execute(
                text("SELECT id, lease_expires_at > now() + interval '5 min' FROM jobs WHERE id = ANY(:i)"),
                {"i": ids},
            ).all()
        )
    assert left == {ids[0]: True, ids[1]: False, ids[2]: True}
