"""The database behind PgBouncer in transaction pooling mode (LLMQ_DATABASE_POOLER=pgbouncer),
with two server connections only, so that consecutive transactions of one client land on
different server connections and any session state (a prepared statement, a session lock,
a SET, an open cursor) would be found missing, or leak to another client, visibly.

The risky paths run there at once: an upload (COPY inside its transaction), a batch's
output download (paged reads), and quota-checked submits racing under the tenant's
advisory lock."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from app.api import create_app
from app.connections import PoolSize
from app.container import build_services
from app.db import Database
from app.errors import RateLimited
from app.services.batch_lifecycle import BatchLifecycle
from tests.helpers import Stores, auth, create, jsonl, line, make_settings, upload
from tests.pgbouncer import Bouncer, start_pgbouncer

SERVER_CONNECTIONS = 2


@pytest.fixture(scope="module")
def bouncer(stores: Stores) -> Iterator[Bouncer]:
    b = start_pgbouncer(stores.admin_url, pool_size=SERVER_CONNECTIONS)
    yield b
    b.stop()


@pytest.fixture(scope="module")
def pooled(stores: Stores, bouncer: Bouncer) -> Stores:
    """The session's database, reached through the two-connection PgBouncer."""
    direct = stores.admin_url
    return Stores(bouncer.url(direct), stores.redis_url, direct_url=direct, pooler="pgbouncer")


def _backend_pid(db: Database) -> int:
    with db.session() as s:
        return int(s.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _on_another_server(db: Database, pooled: Stores) -> tuple[int, int]:
    """Run one statement often enough for psycopg to prepare it (its threshold is 5), then,
    while another client holds that server connection in a transaction, run it again:
    PgBouncer must hand this client the other server connection. Returns both pids."""
    first = {_backend_pid(db) for _ in range(10)}
    assert len(first) == 1  # an idle server connection is reused while nothing else runs
    with psycopg.connect(pooled.database_url, prepare_threshold=None) as holder:
        held = holder.execute("SELECT pg_backend_pid()").fetchone()
        assert held is not None and held[0] in first  # the holder took it
        return first.pop(), _backend_pid(db)


def test_server_side_prepared_statements_are_off_behind_a_transaction_pooler(pooled: Stores) -> None:
    pool = PoolSize(pool=1, overflow=0)
    off = Database.from_url(pooled.database_url, pool, transaction_pooler=True)
    try:
        before, after = _on_another_server(off, pooled)
        assert before != after
    finally:
        off.dispose()
    # The same statements with psycopg's default (prepare after 5 runs) break there: the
    # statement was prepared on the server connection the other client now holds.
    on = Database.from_url(pooled.database_url, pool, transaction_pooler=False)
    try:
        with pytest.raises(DBAPIError, match=r"prepared statement .* does not exist"):
            _on_another_server(on, pooled)
    finally:
        on.dispose()


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


def test_upload_download_and_quota_race_behind_two_server_connections(pooled: Stores) -> None:
    settings = make_settings(pooled, db_pool_size=8, db_max_overflow=8, max_active_jobs_per_tenant=5)
    services = build_services(settings)
    app = create_app(services=services)
    try:
        tenant = f"tenant-bouncer-{secrets.token_hex(3)}"
        key = services.keys.create_key(tenant)
        principal = services.keys.authenticate(key)
        n = 2500  # 3 pages of the paged reads (1000 rows each)
        data = jsonl([line(i) for i in range(n)])
        failures: list[BaseException] = []
        outcomes: list[str] = []
        start = threading.Barrier(17)

        def upload_and_download() -> None:
            try:
                client = app.test_client()
                start.wait()
                r = upload(client, key, data)
                assert r.status_code == 200, r.get_json()
                file_id = r.get_json()["id"]
                assert client.get(f"/v1/files/{file_id}/content", headers=auth(key)).data == data
                b = create(client, key, file_id)
                assert b.status_code == 200, b.get_json()
                batch_id = b.get_json()["id"]
                with services.db.session() as s:
                    s.execute(
                        text(
                            "UPDATE jobs SET status = 'succeeded', "
                            "response = json_build_object('line', line_no) WHERE batch_id = :b"
                        ),
                        {"b": batch_id},
                    )
                lifecycle = BatchLifecycle(services.db, services.queue, services.events, window=64, chunk=8)
                lifecycle.finalize_done()
                batch = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
                assert batch["status"] == "completed", batch
                out = client.get(f"/v1/files/{batch['output_file_id']}/content", headers=auth(key))
                lines = out.data.decode().splitlines()
                assert len(lines) == n
                assert lines[0].count('"custom_id": "req-0"') == 1
                assert lines[-1].count(f'"custom_id": "req-{n - 1}"') == 1
            except BaseException as exc:  # reported by the main thread
                failures.append(exc)

        def submit() -> None:
            start.wait()
            try:
                services.jobs.submit(principal, _chat())
                outcomes.append("created")
            except RateLimited:
                outcomes.append("429")
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=upload_and_download)]
        threads += [threading.Thread(target=submit) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        assert sorted(outcomes) == ["429"] * 11 + ["created"] * 5
        with services.db.session() as s:
            single = s.execute(
                text("SELECT count(*) FROM jobs WHERE tenant_id = :t AND batch_id IS NULL"), {"t": tenant}
            ).scalar()
        assert single == 5
    finally:
        services.close()


def test_the_api_logs_its_connection_budget(pooled: Stores, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="llmq.api")
    services = build_services(make_settings(pooled, db_pool_size=3, db_max_overflow=2))
    services.close()
    assert "postgres connections: up to 5 (pool 3 + overflow 2) per process" in caplog.messages
