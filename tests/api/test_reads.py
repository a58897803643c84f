"""Requests that only read run their statements in autocommit (`Database.reading`): no
BEGIN and no COMMIT round trip around a poll's one SELECT. The pool's connections go back
to transactions afterwards, so a write still commits or rolls back as one."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import event, text

from app.connections import ADMIN_POOL
from app.container import Services
from app.db import Database
from app.models import Job
from app.queue import WAKE_KEY
from app.services.batch_lifecycle import BatchLifecycle
from app.services.jobs import JOB_OBJECT_ONLY, to_job_object
from app.services.ownership import load_owned
from tests.helpers import Stores, auth, create, fresh_database, jsonl, line, upload


@pytest.fixture
def statements(services: Services) -> Iterator[list[tuple[str, bool]]]:
    """(statement, whether its connection was in autocommit) of each statement run."""
    seen: list[tuple[str, bool]] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(
            (statement.split(maxsplit=1)[0].upper(), bool(conn.connection.dbapi_connection.autocommit))
        )

    event.listen(services.db.engine, "before_cursor_execute", before)
    yield seen
    event.remove(services.db.engine, "before_cursor_execute", before)


def test_a_poll_reads_in_autocommit_and_a_write_is_still_one_transaction(
    client: FlaskClient, services: Services, statements: list[tuple[str, bool]]
) -> None:
    key = services.keys.create_key(f"tenant-reads-{secrets.token_hex(3)}")
    assert client.get("/v2/jobs", headers=auth(key)).status_code == 200  # the key is cached now
    statements.clear()
    body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    job_id = client.post("/v2/jobs", json=body, headers=auth(key)).get_json()["id"]
    # The submit's transaction went as one pipelined round trip, past SQLAlchemy's execute
    # (`Database.at_once`, tests/api/test_single_insert.py).
    assert statements == []

    # A poll of one job is one statement past SQLAlchemy's execute too, in autocommit
    # (`Database.returning`, tests/api/test_returning.py).
    assert client.get(f"/v2/jobs/{job_id}", headers=auth(key)).status_code == 200
    assert statements == []

    for path in ("/v2/jobs", f"/v2/jobs/{job_id}/request"):
        statements.clear()
        assert client.get(path, headers=auth(key)).status_code == 200
        assert statements and all(autocommit for _, autocommit in statements), (path, statements)

    # The same pooled connections, back in transactions: a write that fails leaves nothing.
    marker = f"tenant-rollback-{secrets.token_hex(3)}"
    with pytest.raises(RuntimeError), services.db.session() as s:
        s.execute(text("INSERT INTO tenants (id, name) VALUES (:t, :t)"), {"t": marker})
        raise RuntimeError("the caller fails after its insert")
    with services.db.session() as s:
        assert s.scalar(text("SELECT count(*) FROM tenants WHERE id = :t"), {"t": marker}) == 0


def test_a_polls_read_shows_every_column_as_the_orm_reads_it(client: FlaskClient, services: Services) -> None:
    """`GET /v2/jobs/<id>` reads its row with one untyped statement (app/services/jobs.py's
    `_READ_JOB`): every field of the job object, documents with text JSON escapes alter
    (U+2028, U+0000, astral characters) and timestamps included, is what the ORM's select
    of the same row gives; another tenant's job is as absent as a missing one."""
    key = services.keys.create_key(f"tenant-poll-{secrets.token_hex(3)}")
    body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    job_id = client.post("/v2/jobs", json=body, headers=auth(key)).get_json()["id"]
    text_value = "caf\u00e9 \u2028 \U0001f600 nul:\u0000"
    documents = {
        "response": {"choices": [{"message": {"content": text_value}}], "n": 2**60},
        "error": {"error": {"type": "invalid_request_error", "message": text_value, "code": "x"}},
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "stats": {"tokens_per_second": 1.5},
        "power": {"joules": 2.25},
        "meta": {"k": "v\u00e9"},
    }
    with services.db.session() as s:
        tenant_id = s.scalar(text("SELECT tenant_id FROM jobs WHERE id = :id"), {"id": job_id})
        s.execute(
            text(
                "UPDATE jobs SET status = 'failed', response = CAST(:response AS json), "
                "error = CAST(:error AS json), usage = CAST(:usage AS jsonb), "
                "generation_stats = CAST(:stats AS jsonb), power_usage = CAST(:power AS jsonb), "
                "metadata = CAST(:meta AS json), started_at = now() - interval '6 s', "
                "succeeded_at = now() - interval '5 s', failed_at = now() - interval '4 s', "
                "cancelled_at = now() - interval '3 s', expired_at = now() - interval '2 s', "
                "cancel_requested_at = now() - interval '1 s', lease_owner = 'w1', finished_by = 'w2', "
                "custom_id = 'line-1', batch_id = 'batch_x', queue_wait_seconds = 0.5, "
                "ttft_seconds = 0.25, e2e_seconds = 1.5, attempts = 2, epoch = 3 WHERE id = :id"
            ),
            {"id": job_id, **{name: json.dumps(value) for name, value in documents.items()}},
        )
    with services.db.reading() as s:
        orm = to_job_object(load_owned(s, Job, job_id, tenant_id, options=JOB_OBJECT_ONLY))
    polled = client.get(f"/v2/jobs/{job_id}", headers=auth(key))
    assert polled.status_code == 200
    assert polled.get_json() == orm.model_dump(mode="json")
    assert None not in orm.model_dump().values(), orm  # every column was read
    assert orm.response == documents["response"] and orm.metadata == documents["meta"]

    other = services.keys.create_key(f"tenant-poll-{secrets.token_hex(3)}")
    refused = client.get(f"/v2/jobs/{job_id}", headers=auth(other))
    assert refused.status_code == 404
    assert refused.get_json()["error"]["param"] == "job_id"


def test_the_feeders_look_for_owed_lines_is_one_read_in_autocommit(
    services: Services, statements: list[tuple[str, bool]]
) -> None:
    """The batch feeder runs every 0.2 s on every worker, and most rounds find nothing owed:
    that look is one SELECT in autocommit, no BEGIN or COMMIT round trip (window 0: no
    room, so nothing is taken or sent whatever other tests left owed)."""
    BatchLifecycle(services.db, services.queue, services.events, window=0, chunk=8).feed()
    assert statements and statements[0] == ("WITH", True), statements


def test_the_feeders_idle_probe_is_one_read_and_sees_an_active_batch(
    client: FlaskClient, services: Services, stores: Stores, statements: list[tuple[str, bool]]
) -> None:
    """A round with no batch active stops at `any_active`: one SELECT in autocommit, false
    on a database without batches and true once one is in progress; creating the batch
    woke the feeder."""
    fresh = Database.from_url(fresh_database(stores), ADMIN_POOL)
    try:
        assert BatchLifecycle(fresh, services.queue, services.events, chunk=8).any_active() is False
    finally:
        fresh.dispose()
    key = services.keys.create_key(f"tenant-idle-{secrets.token_hex(3)}")
    file_id = upload(client, key, jsonl([line(0, model="api-only")])).get_json()["id"]
    services.redis.delete(WAKE_KEY)
    assert create(client, key, file_id).status_code == 200  # no worker serves api-only: it stays in progress
    assert services.redis.llen(WAKE_KEY) == 1  # the feeder is woken, not left to its idle tick
    statements.clear()
    assert BatchLifecycle(services.db, services.queue, services.events, chunk=8).any_active() is True
    assert statements == [("SELECT", True)]
