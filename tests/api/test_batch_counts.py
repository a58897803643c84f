"""`GET /v1/batches/<id>` counts a batch's lines from what it read last time plus the lines
that ended since (app/services/batch_counts.py): the figures must stay exactly those of a
full count while lines end in transactions that commit out of order, and a poll must not
read every line again."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import replace
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.container import Services
from app.services.batch_counts import BatchCounts
from tests.helpers import auth, create, jsonl, line, upload

TRUTH = text(
    """
    SELECT status, count(*) AS n,
           coalesce(sum((usage->>'prompt_tokens')::bigint), 0) AS prompt,
           coalesce(sum((usage->>'completion_tokens')::bigint), 0) AS completion
    FROM jobs WHERE batch_id = :b GROUP BY status
    """
)


@pytest.fixture
def key(services: Services) -> str:
    return services.keys.create_key(f"tenant-counts-{secrets.token_hex(3)}")


def new_batch(client: FlaskClient, key: str, lines: int) -> str:
    f = upload(client, key, jsonl([line(i) for i in range(lines)])).get_json()
    return str(create(client, key, f["id"]).get_json()["id"])


def line_ids(services: Services, batch_id: str) -> list[str]:
    with services.db.session() as s:
        return list(
            s.scalars(text("SELECT id FROM jobs WHERE batch_id = :b ORDER BY line_no"), {"b": batch_id})
        )


def end(services: Services, ids: list[str], status: str, prompt: int, completion: int) -> None:
    usage = json.dumps(
        {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    )
    with services.db.session() as s:
        s.execute(
            text("UPDATE jobs SET status = :st, usage = CAST(:u AS jsonb) WHERE id = ANY(:ids)"),
            {"st": status, "u": usage, "ids": ids},
        )


def run(services: Services, ids: list[str]) -> None:
    with services.db.session() as s:
        s.execute(text("UPDATE jobs SET status = 'running' WHERE id = ANY(:ids)"), {"ids": ids})


def seen(client: FlaskClient, key: str, batch_id: str) -> dict[str, Any]:
    b = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    progress = {k: v for k, v in b["x_progress"].items() if v}
    usage = b["usage"] or {"input_tokens": 0, "output_tokens": 0}
    return {
        "progress": progress,
        "tokens": (usage["input_tokens"], usage["output_tokens"]),
        **b["request_counts"],
    }


def truth(services: Services, batch_id: str) -> dict[str, Any]:
    with services.db.session() as s:
        rows = s.execute(TRUTH, {"b": batch_id}).all()
    progress = {r.status: r.n for r in rows}
    done = sum(n for st, n in progress.items() if st not in ("queued", "running"))
    return {
        "progress": progress,
        "tokens": (sum(r.prompt for r in rows), sum(r.completion for r in rows)),
        "total": sum(progress.values()),
        "completed": progress.get("succeeded", 0),
        "failed": done - progress.get("succeeded", 0),
    }


def by_status(services: Services, counts: BatchCounts, batch_id: str) -> dict[str, int]:
    with services.db.reading() as s:
        return {c.status: c.n for c in counts.read(s, batch_id) if c.n}


def test_counts_stay_exact_while_lines_end_out_of_order(
    client: FlaskClient, services: Services, key: str
) -> None:
    batch_id = new_batch(client, key, 8)
    ids = line_ids(services, batch_id)
    assert seen(client, key, batch_id) == truth(services, batch_id)
    # A line ended in a transaction that stays open while others end and commit: its id
    # is below theirs, so the horizon stays below every one of them, and they are read
    # again on every poll until it commits; then its line must be counted, and theirs not
    # a second time.
    old = services.db.engine.connect()
    old.begin()
    try:
        old.execute(
            text("UPDATE jobs SET status = 'failed', usage = CAST(:u AS jsonb) WHERE id = :id"),
            {"id": ids[7], "u": json.dumps({"prompt_tokens": 3, "completion_tokens": 0})},
        )
        end(services, ids[:2], "succeeded", 10, 3)
        assert seen(client, key, batch_id) == truth(services, batch_id)
        run(services, ids[2:4])
        end(services, ids[4:5], "failed", 7, 0)
        assert seen(client, key, batch_id) == truth(services, batch_id)
        assert seen(client, key, batch_id) == truth(services, batch_id)
        assert seen(client, key, batch_id)["progress"]["failed"] == 1  # not yet committed
        # A process reading the batch for the first time now keeps only what is settled.
        first = BatchCounts()
        for _ in range(2):
            assert by_status(services, first, batch_id) == truth(services, batch_id)["progress"]
        old.commit()
    finally:
        old.close()
    # Now settled: taken into what is kept, and not counted a second time.
    for _ in range(3):
        assert seen(client, key, batch_id) == truth(services, batch_id)
    assert by_status(services, first, batch_id) == truth(services, batch_id)["progress"]
    end(services, ids[2:4], "succeeded", 1, 1)
    end(services, ids[5:7], "expired", 0, 0)
    got = seen(client, key, batch_id)
    assert got == truth(services, batch_id)
    assert got["progress"] == {"succeeded": 4, "failed": 2, "expired": 2}
    assert got["tokens"] == (10 * 2 + 7 + 3 + 1 * 2, 3 * 2 + 1 * 2)


def test_a_poll_reads_only_the_lines_that_ended_since_the_last(
    client: FlaskClient, services: Services, key: str
) -> None:
    batch_id = new_batch(client, key, 4)
    ids = line_ids(services, batch_id)
    end(services, ids[:2], "succeeded", 5, 5)
    with services.db.session() as s:
        ended_in = s.scalar(text("SELECT max(finished_xid) FROM jobs WHERE id = ANY(:ids)"), {"ids": ids[:2]})
    deadline = time.monotonic() + 10
    while True:  # until the poll keeps those lines as settled (no transaction holds it back)
        assert seen(client, key, batch_id)["tokens"] == (10, 10)
        if services.batches._counts._settled[batch_id].horizon > ended_in:
            break
        assert time.monotonic() < deadline, "the horizon never passed the lines"
        time.sleep(0.05)
    # Nothing in llmq rewrites a line that ended; this does, behind the service's back, to
    # show the poll does not read that line again.
    with services.db.session() as s:
        s.execute(
            text("UPDATE jobs SET usage = CAST(:u AS jsonb) WHERE id = :id"),
            {"id": ids[0], "u": json.dumps({"prompt_tokens": 500, "completion_tokens": 500})},
        )
    assert seen(client, key, batch_id)["tokens"] == (10, 10)
    with services.db.reading() as s:
        fresh = {c.status: c for c in BatchCounts().read(s, batch_id)}  # another process
    assert (fresh["succeeded"].prompt, fresh["succeeded"].n) == (505, 2)


def test_a_process_keeps_a_bounded_number_of_batches(
    client: FlaskClient, services: Services, key: str
) -> None:
    counts = BatchCounts(size=2)
    batches = [new_batch(client, key, 2) for _ in range(3)]
    with services.db.reading() as s:
        for batch_id in batches:
            assert {c.status: c.n for c in counts.read(s, batch_id)} == {"queued": 2}
    assert list(counts._settled) == batches[1:]


def test_counts_that_no_longer_add_up_are_counted_again(
    client: FlaskClient, services: Services, key: str
) -> None:
    batch_id = new_batch(client, key, 3)
    ids = line_ids(services, batch_id)
    counts = BatchCounts()
    end(services, ids[:1], "succeeded", 2, 2)
    assert by_status(services, counts, batch_id) == {"succeeded": 1, "queued": 2}
    kept = counts._settled[batch_id]
    # A horizon that went back (a failover to a standby that lost transactions, say) ...
    counts._settled[batch_id] = replace(kept, horizon=kept.horizon + 10**9)
    end(services, ids[1:2], "failed", 0, 0)
    assert by_status(services, counts, batch_id) == truth(services, batch_id)["progress"]
    # ... or more lines ended than the batch has.
    counts._settled[batch_id] = replace(counts._settled[batch_id], rows=1)
    assert by_status(services, counts, batch_id) == truth(services, batch_id)["progress"]
    assert counts._settled[batch_id].rows == 3
