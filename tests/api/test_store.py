"""The worker's job store against real Postgres: claims, the epoch fence, bulk results."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import psycopg
from sqlalchemy import text

from app.liveness import FEEDER_PLANS, OWED_BY_TENANT, TAKE_OWED
from tests.helpers import queued, response
from worker.store import _CLAIM, _CLAIM_ONE, _FINISH, JobStore, Result


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
            response=response("a\u0000b é ☃ \U0001f600 \u2028"),
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
    assert rows[ids[0]].response["choices"][0]["message"]["content"] == "a\u0000b é ☃ \U0001f600 \u2028"
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


# `n` copies of the job `template`, ids `prefix` 1..n, as lines of `batch` (or single jobs).
_COPIES = text(
    "INSERT INTO jobs (id, tenant_id, kind, status, priority, model, request, created_at, "
    "batch_id, line_no) SELECT :prefix || g, tenant_id, kind, :status, priority, model, request, "
    "now(), :batch, g FROM jobs, generate_series(1, :n) AS g WHERE id = :template"
)


def _indexes(plan: Any) -> set[str]:
    """Every index an EXPLAIN (FORMAT JSON) plan reads."""
    if isinstance(plan, list):
        return set().union(*map(_indexes, plan)) if plan else set()
    if not isinstance(plan, dict):
        return set()
    found = {plan["Index Name"]} if "Index Name" in plan else set()
    return found.union(*(_indexes(v) for v in plan.values() if isinstance(v, (list, dict))))


def test_a_single_jobs_claim_is_planned_once_by_its_key(services) -> None:
    """A claim of one id is prepared (as psycopg does after five runs) with a generic plan,
    the primary key, not planned again at each run: with `id = ANY(:ids)` the planner's
    generic guess was many rows and it planned every claim afresh, half of the claim's
    Postgres time under a stream of single jobs. Among 2,000 ended jobs (in a table of a few
    rows a scan is the cheaper plan). Rolled back."""
    ids = queued(services, 8)
    types = {"owner": "text", "lease": "float8", "id": "text", "max_attempts": "int", "max_request": "bigint"}
    order = list(dict.fromkeys(re.findall(r"(?<!:):(\w+)", _CLAIM_ONE.text)))
    assert set(order) == set(types)
    sql = re.sub(r"(?<!:):(\w+)", lambda m: f"${order.index(m.group(1)) + 1}", _CLAIM_ONE.text)
    with services.db.session() as s:
        done = {"template": ids[0], "batch": None, "prefix": "job_done_", "status": "succeeded", "n": 2000}
        s.execute(_COPIES, done)
        s.execute(text("ANALYZE jobs"))
        s.execute(text(f"PREPARE claim_one ({', '.join(types[n] for n in order)}) AS {sql}"))
        values = {"owner": "'w1'", "lease": "30", "max_attempts": "3", "max_request": "1099511627776"}
        for job_id in ids:
            run = ", ".join(f"'{job_id}'" if n == "id" else values[n] for n in order)
            assert s.execute(text(f"EXECUTE claim_one ({run})")).one()[0] == job_id
        generic, custom = s.execute(
            text("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 'claim_one'")
        ).one()
        assert generic >= len(ids) - 5 and custom <= 5, (generic, custom)
        run = ", ".join("'job_none'" if n == "id" else values[n] for n in order)
        assert _indexes(s.scalar(text(f"EXPLAIN (FORMAT JSON) EXECUTE claim_one ({run})"))) == {"pk_jobs"}
        s.rollback()


def test_claims_and_the_feeder_read_the_right_index_while_statistics_predate_a_burst(services) -> None:
    """Right after a batch's lines are inserted, the table's statistics (its last ANALYZE saw
    no job queued) expect one queued job where there are thousands. A claim must still find
    its rows by their ids, and the feeder its lines through ix_jobs_undispatched, not walk
    ix_jobs_active (every queued and running job) as they did. Run in one transaction that is
    rolled back, the statistics included."""
    (template,) = queued(services, 1)
    with services.db.session() as s:
        tenant = s.scalar(text("SELECT tenant_id FROM jobs WHERE id = :i"), {"i": template})
        s.execute(text("DELETE FROM jobs WHERE id <> :i"), {"i": template})
        s.execute(text("UPDATE jobs SET status = 'succeeded' WHERE id = :i"), {"i": template})
        params = {"template": template, "batch": None}
        s.execute(_COPIES, {**params, "prefix": "job_done_", "status": "succeeded", "n": 2000})
        s.execute(text("ANALYZE jobs"))
        params = {"template": template, "batch": "batch_burst"}
        s.execute(_COPIES, {**params, "prefix": "job_line_", "status": "queued", "n": 5000})
        explain = "EXPLAIN (FORMAT JSON) "
        claim = {
            "ids": [f"job_line_{i}" for i in range(100, 132)],
            "owner": "w1",
            "lease": 30,
            "max_attempts": 3,
            "max_request": 2**40,
        }
        assert _indexes(s.scalar(text(explain + _CLAIM.text), claim)) == {"pk_jobs"}
        # Results: the rows by their ids too, not every running job (the statistics saw none).
        running = {**params, "batch": None, "prefix": "job_run_", "status": "running", "n": 3000}
        s.execute(_COPIES, running)
        rows = [{"id": f"job_run_{i}", "epoch": 0, "status": "succeeded"} for i in range(1, 33)]
        finish = {"rows": json.dumps(rows), "ids": [r["id"] for r in rows]}
        read = _indexes(s.scalar(text(explain + _FINISH.text), finish))
        assert "pk_jobs" in read and "ix_jobs_active" not in read, read
        s.execute(FEEDER_PLANS)
        feed = {"model": "api-only", "tenant": tenant, "n": 128, "cap": 2048}
        for query in (OWED_BY_TENANT, TAKE_OWED):
            read = _indexes(s.scalar(text(explain + query.text), feed))
            assert "ix_jobs_undispatched" in read and "ix_jobs_active" not in read, (query.text, read)
        s.rollback()
