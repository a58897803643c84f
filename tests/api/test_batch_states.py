"""Batches seen from outside: every state of OpenAI's lifecycle is committed on its own
(so a reader can see it), the listing costs the same number of queries whatever the page
size, and finalizing measures its files without holding the batch's row lock."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient
from sqlalchemy import event, text

from app.container import Services
from app.domain.status import JobStatus
from app.services import batch_lifecycle
from app.services.batch_lifecycle import BatchLifecycle
from app.services.batch_transitions import end_lines
from tests.helpers import Stores, auth, create, jsonl, line, upload


@pytest.fixture
def tenant(services: Services) -> tuple[str, str]:
    name = f"tenant-states-{secrets.token_hex(3)}"
    return name, services.keys.create_key(name)


def lifecycle(services: Services) -> BatchLifecycle:
    return BatchLifecycle(services.db, services.queue, services.events, window=64, chunk=8)


def succeed_all(services: Services, batch_id: str) -> None:
    with services.db.session() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', succeeded_at = now(), epoch = epoch + 1, "
                "response = CAST(:r AS json) WHERE batch_id = :b"
            ),
            {"b": batch_id, "r": '{"object": "chat.completion", "choices": []}'},
        )


@contextmanager
def counting(services: Services) -> Iterator[list[str]]:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(services.db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(services.db.engine, "before_cursor_execute", count)


def test_listing_costs_the_same_queries_whatever_the_page_size(
    client: FlaskClient, services: Services, tenant: tuple[str, str]
) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()
    for _ in range(12):
        assert create(client, key, f["id"]).status_code == 200
    costs = {}
    for size in (1, 12):
        with counting(services) as statements:
            page = client.get(f"/v1/batches?limit={size}", headers=auth(key)).get_json()
        assert len(page["data"]) == size
        assert all(b["request_counts"]["total"] == 3 and b["model"] == "api-only" for b in page["data"])
        costs[size] = len(statements)
    assert costs[12] == costs[1], costs
    assert costs[12] <= 5, costs  # the key, the page, its counts, its models


def test_get_and_cancel_hold_one_connection_at_a_time(
    client: FlaskClient, services: Services, tenant: tuple[str, str]
) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(0)])).get_json()
    batch_id = create(client, key, f["id"]).get_json()["id"]
    held, peak = [0], [0]

    def checkout(*_: Any) -> None:
        held[0] += 1
        peak[0] = max(peak[0], held[0])

    def checkin(*_: Any) -> None:
        held[0] -= 1

    event.listen(services.db.engine, "checkout", checkout)
    event.listen(services.db.engine, "checkin", checkin)
    try:
        for _ in range(2):  # the second cancel finds the batch cancelling already
            r = client.post(f"/v1/batches/{batch_id}/cancel", headers=auth(key))
            assert r.status_code == 200 and r.get_json()["status"] == "cancelling"
        client.get(f"/v1/batches/{batch_id}", headers=auth(key))
    finally:
        event.remove(services.db.engine, "checkout", checkout)
        event.remove(services.db.engine, "checkin", checkin)
    assert peak[0] == 1


@contextmanager
def audited(stores: Stores, tenant: str) -> Iterator[list[tuple[str, int]]]:
    """Every status a batch of `tenant` is written with, and the transaction writing it."""
    name = f"llmq_test_audit_{secrets.token_hex(3)}"
    rows: list[tuple[str, int]] = []
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (n serial, status text, tx bigint)")
        conn.execute(
            f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"INSERT INTO {name} (status, tx) VALUES (NEW.status, txid_current()); RETURN NEW; END $$"
        )
        conn.execute(
            f"CREATE TRIGGER {name} AFTER INSERT OR UPDATE ON batches FOR EACH ROW "
            f"WHEN (NEW.tenant_id = '{tenant}') EXECUTE FUNCTION {name}()"
        )
    try:
        yield rows
    finally:
        with psycopg.connect(stores.database_url, autocommit=True) as conn:
            rows.extend((r[0], r[1]) for r in conn.execute(f"SELECT status, tx FROM {name} ORDER BY n"))
            conn.execute(f"DROP TRIGGER {name} ON batches")
            conn.execute(f"DROP FUNCTION {name}()")
            conn.execute(f"DROP TABLE {name}")


def transitions(rows: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The statuses in the order written, each with the transaction that first wrote it."""
    out: list[tuple[str, int]] = []
    for status, tx in rows:
        if not out or out[-1][0] != status:
            out.append((status, tx))
    return out


def test_lifecycle_commits_validating_and_finalizing(
    client: FlaskClient, services: Services, stores: Stores, tenant: tuple[str, str]
) -> None:
    name, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(4)])).get_json()
    with audited(stores, name) as rows:
        batch = create(client, key, f["id"]).get_json()
        succeed_all(services, batch["id"])
        assert lifecycle(services).finalize_done() >= 1
    seen = transitions(rows)
    assert [s for s, _ in seen] == ["validating", "in_progress", "finalizing", "completed"]
    # Each state committed by itself: another reader could see it.
    assert len({tx for _, tx in seen}) == 4
    final = client.get(f"/v1/batches/{batch['id']}", headers=auth(key)).get_json()
    assert final["created_at"] <= final["in_progress_at"] <= final["finalizing_at"] <= final["completed_at"]
    assert final["request_counts"] == {"total": 4, "completed": 4, "failed": 0}


def test_a_cancelled_batch_goes_cancelling_then_cancelled_never_finalizing(
    client: FlaskClient, services: Services, stores: Stores, tenant: tuple[str, str]
) -> None:
    """OpenAI's states: `finalizing` is for a batch that ran to its end; a cancelled one
    stays `cancelling` while its files are made, then is `cancelled`."""
    name, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(4)])).get_json()
    with audited(stores, name) as rows:
        batch = create(client, key, f["id"]).get_json()
        r = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key))
        assert r.get_json()["status"] == "cancelling"
        assert lifecycle(services).finalize_done() >= 1
    assert [s for s, _ in transitions(rows)] == ["validating", "in_progress", "cancelling", "cancelled"]
    final = client.get(f"/v1/batches/{batch['id']}", headers=auth(key)).get_json()
    assert final["finalizing_at"] is None and final["cancelled_at"] is not None


def test_a_batch_whose_lines_all_ended_before_its_window_closed_is_completed(
    client: FlaskClient, services: Services, tenant: tuple[str, str]
) -> None:
    """The expiry sweep ends batches with lines left to end; one whose last line finished
    before the sweep saw its window pass is completed, and the other one expires."""
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()
    done, running = (create(client, key, f["id"]).get_json()["id"] for _ in range(2))
    succeed_all(services, done)
    with services.db.session() as s:
        s.execute(
            text("UPDATE batches SET expires_at = now() - interval '1 second' WHERE id = ANY(:b)"),
            {"b": [done, running]},
        )
    life = lifecycle(services)
    life.expire_due()
    life.finalize_done()
    statuses = {
        b: client.get(f"/v1/batches/{b}", headers=auth(key)).get_json()["status"] for b in (done, running)
    }
    assert statuses == {done: "completed", running: "expired"}


def test_a_batch_left_validating_is_taken_up_again(
    client: FlaskClient, services: Services, tenant: tuple[str, str]
) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()
    batch_id = create(client, key, f["id"]).get_json()["id"]
    with services.db.session() as s:  # as if the API died after the first commit
        s.execute(text("DELETE FROM jobs WHERE batch_id = :b"), {"b": batch_id})
        s.execute(
            text(
                "UPDATE batches SET status = 'validating', in_progress_at = NULL, "
                "created_at = now() - interval '5 minutes' WHERE id = :b"
            ),
            {"b": batch_id},
        )
    seen = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert seen["status"] == "validating" and seen["in_progress_at"] is None
    assert lifecycle(services).resume_validating(grace_seconds=60) >= 1
    resumed = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert resumed["status"] == "in_progress" and resumed["x_progress"]["queued"] == 3


def test_finalizing_measures_files_without_the_row_lock(
    client: FlaskClient,
    services: Services,
    stores: Stores,
    tenant: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(5)])).get_json()
    batch_id = create(client, key, f["id"]).get_json()["id"]
    succeed_all(services, batch_id)
    render = batch_lifecycle.output_lines
    lock_free: list[bool] = []

    def probe(db: Any, batch: str, part: str) -> Iterator[bytes]:
        with psycopg.connect(stores.database_url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            try:
                conn.execute("SELECT 1 FROM batches WHERE id = %s FOR UPDATE", (batch,))
                lock_free.append(True)
            except psycopg.errors.LockNotAvailable:
                lock_free.append(False)
        yield from render(db, batch, part)

    monkeypatch.setattr(batch_lifecycle, "output_lines", probe)
    assert lifecycle(services).finalize_done() >= 1
    assert lock_free == [True]
    done = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert done["status"] == "completed"
    meta = client.get(f"/v1/files/{done['output_file_id']}", headers=auth(key)).get_json()
    content = client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key)).data
    assert meta["bytes"] == len(content) and len(content.splitlines()) == 5


def running_lines(services: Services, batch_id: str) -> list[str]:
    with services.db.session() as s:
        return list(
            s.scalars(
                text(
                    "UPDATE jobs SET status = 'running', epoch = epoch + 1, lease_owner = 'w', "
                    "lease_expires_at = now() + interval '1 minute' WHERE batch_id = :b RETURNING id"
                ),
                {"b": batch_id},
            )
        )


def test_ending_lines_skips_a_line_a_worker_holds_and_cannot_deadlock_with_it(
    client: FlaskClient, services: Services, stores: Stores, tenant: tuple[str, str]
) -> None:
    """CI once got a 500 from a cancel: waiting for a line a worker's statement held
    while holding the batch's other lines, which that statement wanted next."""
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(4)])).get_json()
    batch_id = create(client, key, f["id"]).get_json()["id"]
    first, *_, last = ids = sorted(running_lines(services, batch_id))
    ended: list[list[tuple[str, int, str]]] = []
    with psycopg.connect(stores.database_url) as worker:  # one transaction, as a worker's statement
        worker.execute("SELECT 1 FROM jobs WHERE id = %s FOR UPDATE", (last,))
        ending = threading.Thread(
            target=lambda: ended.append(end_lines(services.db, batch_id, JobStatus.CANCELLED))
        )
        ending.start()
        time.sleep(0.3)
        # The worker's statement goes on to another line: cancelled already, not locked.
        assert (
            worker.execute(
                "UPDATE jobs SET status = 'succeeded' WHERE id = %s AND status = 'running'", (first,)
            ).rowcount
            == 0
        )
        worker.execute("UPDATE jobs SET status = 'succeeded' WHERE id = %s AND status = 'running'", (last,))
        worker.commit()
        ending.join(10)
    assert not ending.is_alive() and len(ended) == 1
    assert sorted(job_id for job_id, _, before in ended[0] if before == "running") == ids[:-1]
    with services.db.session() as s:
        found = s.execute(text("SELECT id, status FROM jobs WHERE batch_id = :b"), {"b": batch_id})
        statuses = dict(found.all())
    assert statuses == {**{i: "cancelled" for i in ids[:-1]}, last: "succeeded"}


@pytest.mark.parametrize("end", ["cancelling", "expired"])
def test_lines_a_dead_api_left_unended_are_ended_by_the_lifecycle(
    client: FlaskClient, services: Services, tenant: tuple[str, str], end: str
) -> None:
    """The API marks the batch, then ends its lines: died in between, the batch would
    otherwise run on, its lines to the end, under a cancel that was acknowledged."""
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(3)])).get_json()
    batch_id = create(client, key, f["id"]).get_json()["id"]
    running_lines(services, batch_id)
    mark = (
        "status = 'cancelling', cancelling_at = now() - interval '1 minute'"
        if end == "cancelling"
        else "expires_at = now() - interval '2 minutes', expired_at = now() - interval '1 minute'"
    )
    with services.db.session() as s:
        s.execute(text(f"UPDATE batches SET {mark} WHERE id = :b"), {"b": batch_id})
    life = lifecycle(services)
    assert life.end_left_lines() >= 1
    with services.db.session() as s:
        statuses = set(s.scalars(text("SELECT status FROM jobs WHERE batch_id = :b"), {"b": batch_id}))
    assert statuses == {"cancelled" if end == "cancelling" else "expired"}
    life.finalize_done()
    final = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert final["status"] == ("cancelled" if end == "cancelling" else "expired")
