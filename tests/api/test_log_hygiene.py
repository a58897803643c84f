"""Under a Postgres fault on every write path, no log line holds a prompt or a key, and a
key of a shape other than llmq's own is masked wherever a key could be logged.

Faults are triggers that raise for this test's rows only (other tests share the database):
the job insert, the batch file's line insert, the batch's job rows insert, the worker's
result write, and a key's registration."""

from __future__ import annotations

import io
import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from flask.testing import FlaskClient
from sqlalchemy.exc import SQLAlchemyError

from app.container import Services
from app.logs import JsonFormatter, KeyValueFormatter, configure_logging, mask_secrets
from app.settings import Settings
from tests.helpers import Stores, auth
from tests.unit.fakes import fake_runner
from worker.loop import LoopThread
from worker.store import JobStore

SUFFIX = secrets.token_hex(4)
TENANT = f"tenant-logs-{SUFFIX}"
# Short: SQLAlchemy cuts long parameter reprs, which would hide a leak from the test.
PROMPT = f"p{SUFFIX}"
KEY = f"sk-{secrets.token_urlsafe(24)}"  # not llmq's shape
OTHER_KEY = f"tok{secrets.token_hex(16)}"  # no known shape at all


@contextmanager
def captured() -> Iterator[io.StringIO]:
    """Every record, through both of llmq's formatters, at every level."""
    out = io.StringIO()
    handlers = [logging.StreamHandler(out), logging.StreamHandler(out)]
    handlers[0].setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handlers[1].setFormatter(JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    for h in handlers:
        root.addHandler(h)
    try:
        yield out
    finally:
        for h in handlers:
            root.removeHandler(h)
        root.setLevel(level)


@contextmanager
def fault(stores: Stores, table: str, allowed: str) -> Iterator[None]:
    """Postgres refuses the rows of `table` (inserted or updated) for which `allowed` is
    false. A CHECK violation is the richest error Postgres sends: its DETAIL holds the
    failing row's values (and a COPY's CONTEXT the line being copied)."""
    name = f"llmq_test_fault_{SUFFIX}"
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({allowed}) NOT VALID")
    try:
        yield
    finally:
        with psycopg.connect(stores.database_url, autocommit=True) as conn:
            conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}")


def body(**fields: object) -> dict[str, object]:
    return {"model": "api-only", "messages": [{"role": "user", "content": PROMPT}], **fields}


def assert_clean(out: io.StringIO) -> None:
    text = out.getvalue()
    assert text, "the fault logged nothing: the test would check nothing"
    for line in text.splitlines():
        assert PROMPT not in line
        assert KEY not in line and KEY[:12] not in line
        assert OTHER_KEY not in line and OTHER_KEY[:12] not in line


@pytest.fixture(scope="module")
def key(services: Services) -> str:
    return services.keys.create_key(TENANT, key=KEY)


def test_job_insert_fault(client: FlaskClient, stores: Stores, key: str) -> None:
    with captured() as out, fault(stores, "jobs", f"tenant_id <> '{TENANT}'"):
        r = client.post("/v2/jobs", json=body(), headers=auth(key))
    assert r.status_code == 500
    assert_clean(out)


def test_batch_line_insert_faults(client: FlaskClient, stores: Stores, key: str) -> None:
    line = (
        f'{{"body": {{"messages": [{{"role": "user", "content": "{PROMPT}"}}], "model": "api-only"}}, '
        '"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}\n'
    ).encode()
    with captured() as out, fault(stores, "file_lines", f"raw NOT LIKE '%{PROMPT}%'"):
        r = client.post(
            "/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")}, headers=auth(key)
        )
    assert r.status_code == 500
    assert_clean(out)
    uploaded = client.post(
        "/v1/files", data={"purpose": "batch", "file": (io.BytesIO(line), "in.jsonl")}, headers=auth(key)
    )
    assert uploaded.status_code == 200
    with captured() as out, fault(stores, "jobs", f"tenant_id <> '{TENANT}'"):
        r = client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.get_json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "metadata": {"note": PROMPT},
            },
            headers=auth(key),
        )
    assert r.status_code == 500
    assert_clean(out)
    # The caller was told it failed, so the batch does not run later: it ended failed.
    (batch,) = client.get("/v1/batches?limit=1", headers=auth(key)).get_json()["data"]
    assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "batch_not_created"


def test_result_write_fault(client: FlaskClient, services: Services, stores: Stores, key: str) -> None:
    # `echo` puts the last (assistant) message into the result itself.
    request = body(
        messages=[{"role": "user", "content": PROMPT}, {"role": "assistant", "content": PROMPT}],
        echo=True,
        add_generation_prompt=False,
        continue_final_message=True,
        max_tokens=3,
    )
    job_id = client.post("/v2/jobs", json=request, headers=auth(key)).get_json()["id"]
    loop = LoopThread()
    loop.start()
    runner = fake_runner(JobStore(services.db), loop, name="w-logs")
    try:
        with (
            captured() as out,
            fault(stores, "jobs", f"tenant_id <> '{TENANT}' OR status <> 'succeeded'"),
        ):
            status = runner.run(job_id)
    finally:
        loop.stop()
    assert status == "failed"
    job = client.get(f"/v2/jobs/{job_id}", headers=auth(key)).get_json()
    assert job["error"]["code"] == "result_not_stored"
    assert_clean(out)


def test_key_registration_fault(services: Services, stores: Stores) -> None:
    tenant = f"{TENANT}-b"
    log = logging.getLogger("llmq.test")
    with captured() as out, fault(stores, "api_keys", f"tenant_id <> '{tenant}'"):
        with pytest.raises(SQLAlchemyError) as exc:
            services.keys.create_key(tenant, key=OTHER_KEY)
        log.error("could not register a key: %s", exc.value)
    assert_clean(out)


def test_keys_of_any_shape_are_masked(settings: Settings) -> None:
    """Wherever a key could be logged: a header, a `key=` field, an `extra` field, the
    bootstrap key, a key of no known shape at all."""
    bootstrap = f"boot.{secrets.token_hex(8)}"
    configure_logging(settings.model_copy(update={"bootstrap_api_key": bootstrap}))
    log = logging.getLogger("llmq.test")
    odd = f"zz{secrets.token_hex(10)}"
    with captured() as out:
        log.warning("request headers %s", {"Authorization": f"Bearer {odd}"})
        log.warning("Authorization: Bearer %s", KEY)
        log.warning("client retried key=%s api_key: %s", odd, KEY)
        log.warning('{"api_key": "%s", "token": "%s"}', odd, KEY)
        log.warning("registered", extra={"api_key": odd, "key": KEY, "authorization": f"Basic {odd}"})
        log.warning("bootstrap %s at start", bootstrap)
        log.warning("redis at redis://user:%s@host:6379/0", odd)
    text = out.getvalue()
    assert text.count("***") >= 10
    for secret in (KEY, odd, bootstrap):
        assert secret not in text
    harmless = "key_id=key_abc max_tokens=5 prompt_tokens=3"
    assert mask_secrets(harmless) == harmless
