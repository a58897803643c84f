"""Files and Batches through the Flask app, against real Postgres and Redis (no worker:
lines stay queued unless a test drives the batch lifecycle itself)."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.schemas.batches import BatchObject, BatchOutputLine, FileObject
from app.services.batch_lifecycle import BatchLifecycle
from tests.helpers import auth, create, jsonl, line, upload


def file_count(services, tenant: str) -> int:  # type: ignore[no-untyped-def]
    with services.db.session() as s:
        return int(s.execute(text("SELECT count(*) FROM files WHERE tenant_id = :t"), {"t": tenant}).scalar())


@pytest.fixture
def tenant(services) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    import secrets

    name = f"tenant-batch-{secrets.token_hex(3)}"
    return name, services.keys.create_key(name)


def test_upload_list_get_and_content_round_trip(client: FlaskClient, tenant) -> None:
    _, key = tenant
    data = jsonl([line(i) for i in range(3)])
    r = upload(client, key, data)
    assert r.status_code == 200, r.get_json()
    f = FileObject.model_validate(r.get_json())
    assert f.purpose == "batch" and f.bytes == len(data) and f.filename == "input.jsonl"
    assert client.get(f"/v1/files/{f.id}", headers=auth(key)).get_json()["id"] == f.id
    assert [x["id"] for x in client.get("/v1/files", headers=auth(key)).get_json()["data"]] == [f.id]
    assert client.get(f"/v1/files/{f.id}/content", headers=auth(key)).data == data


def lines_of(services, file_id: str) -> int:  # type: ignore[no-untyped-def]
    with services.db.session() as s:
        return int(s.scalar(text("SELECT count(*) FROM file_lines WHERE file_id = :f"), {"f": file_id}))


def test_a_files_lines_go_with_it_however_its_row_is_deleted(client: FlaskClient, tenant, services) -> None:
    """No foreign key checks each line (migration 0022): the files_delete_lines trigger
    deletes them, through the API, a plain DELETE, and a tenant's cascade alike."""
    name, key = tenant
    ids = [upload(client, key, jsonl([line(i) for i in range(3)])).get_json()["id"] for _ in range(3)]
    assert [lines_of(services, f) for f in ids] == [3, 3, 3]
    assert client.delete(f"/v1/files/{ids[0]}", headers=auth(key)).status_code == 200
    with services.db.session() as s:
        s.execute(text("DELETE FROM files WHERE id = :f"), {"f": ids[1]})
    assert [lines_of(services, f) for f in ids] == [0, 0, 3]
    with services.db.session() as s:
        s.execute(text("DELETE FROM tenants WHERE id = :t"), {"t": name})
    assert lines_of(services, ids[2]) == 0


def test_one_bad_line_among_1000_rejects_the_file_and_names_it(client: FlaskClient, tenant, services) -> None:
    name, key = tenant
    lines: list[Any] = [line(i) for i in range(1000)]
    lines[636] = line(636, temperature="hot")
    r = upload(client, key, jsonl(lines))
    assert r.status_code == 400
    body = r.get_json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["errors"]["data"] == [
        {
            "code": "float_parsing",
            "message": body["errors"]["data"][0]["message"],
            "param": "body.temperature",
            "line": 637,
        }
    ]
    assert "line 637" in body["error"]["message"]
    assert file_count(services, name) == 0


@pytest.mark.parametrize(
    ("bad", "code", "param"),
    [
        (b"{not json", "invalid_json", None),
        (b"[1, 2]", "invalid_line", None),
        (
            json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}).encode(),
            "missing",
            "custom_id",
        ),
        (json.dumps({**line(1), "url": "/v1/embeddings"}).encode(), "invalid_url", "url"),
        (json.dumps(line(1, stream=True)).encode(), "invalid_line", "body.stream"),
        (json.dumps(line(1, frobnicate=1)).encode(), "extra_forbidden", "body.frobnicate"),
        (json.dumps(line(1, n=1000)).encode(), None, "body.n"),
        (json.dumps(line(1, use_beam_search=True)).encode(), "unsupported_parameter", "body.use_beam_search"),
        (json.dumps(line(1, model="nope")).encode(), "model_not_found", "body.model"),
        (b'{"custom_id": "\xff"}', "invalid_utf8", None),
        (json.dumps(line(0)).encode(), "duplicate_custom_id", "custom_id"),
    ],
)
def test_bad_lines_are_reported_with_their_number(
    client: FlaskClient, tenant, services, bad, code, param
) -> None:
    name, key = tenant
    r = upload(client, key, jsonl([line(0)]) + bad + b"\n")
    assert r.status_code == 400, r.get_json()
    (err,) = r.get_json()["errors"]["data"]
    assert err["line"] == 2
    if code:
        assert err["code"] == code
    assert err["param"] == param
    assert file_count(services, name) == 0


def test_every_bad_line_is_reported_together(client: FlaskClient, tenant) -> None:
    _, key = tenant
    r = upload(client, key, jsonl([line(0), b"oops", line(2), b"[]"]))
    assert [e["line"] for e in r.get_json()["errors"]["data"]] == [2, 4]


def test_wrong_purpose_and_missing_file(client: FlaskClient, tenant) -> None:
    _, key = tenant
    assert (
        upload(client, key, jsonl([line(0)]), purpose="fine-tune").get_json()["error"]["param"] == "purpose"
    )
    r = client.post(
        "/v1/files", data={"purpose": "batch"}, headers=auth(key), content_type="multipart/form-data"
    )
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "file"


def test_batch_lines_become_jobs_and_cancel_keeps_nothing_running(
    client: FlaskClient, tenant, services
) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(i) for i in range(5)])).get_json()
    r = create(client, key, f["id"], metadata={"run": "a"})
    assert r.status_code == 200, r.get_json()
    batch = BatchObject.model_validate(r.get_json())
    assert (
        batch.status == "in_progress" and batch.request_counts.total == 5 and batch.metadata == {"run": "a"}
    )
    assert batch.x_progress.queued == 5 and batch.model == "api-only"
    jobs = client.get(f"/v2/jobs?batch_id={batch.id}&limit=100", headers=auth(key)).get_json()["data"]
    assert sorted(j["custom_id"] for j in jobs) == [f"req-{i}" for i in range(5)]
    assert all(j["status"] == "queued" and j["batch_id"] == batch.id for j in jobs)
    # The input file is in use.
    assert client.delete(f"/v1/files/{f['id']}", headers=auth(key)).status_code == 409
    cancelled = client.post(f"/v1/batches/{batch.id}/cancel", headers=auth(key)).get_json()
    assert cancelled["status"] == "cancelling" and cancelled["x_progress"]["cancelled"] == 5
    lifecycle = BatchLifecycle(services.db, services.queue, services.events, window=64, chunk=8)
    assert lifecycle.finalize_done() >= 1
    final = BatchObject.model_validate(client.get(f"/v1/batches/{batch.id}", headers=auth(key)).get_json())
    assert final.status == "cancelled" and final.cancelled_at and final.finalizing_at is None
    assert final.output_file_id is None and final.error_file_id
    errors = (
        client.get(f"/v1/files/{final.error_file_id}/content", headers=auth(key)).data.decode().splitlines()
    )
    parsed = [BatchOutputLine.model_validate_json(x) for x in errors]
    assert [p.custom_id for p in parsed] == [f"req-{i}" for i in range(5)]
    assert all(p.response is None and p.error and p.error.code == "batch_cancelled" for p in parsed)
    assert (
        client.post(f"/v1/batches/{batch.id}/cancel", headers=auth(key)).get_json()["status"] == "cancelled"
    )
    retry = client.post(f"/v1/batches/{batch.id}/retry", headers=auth(key)).get_json()
    assert retry["x_parent_batch_id"] == batch.id and retry["request_counts"]["total"] == 5


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"endpoint": "/v2/chat/completions"}, "endpoint"),  # the lines say /v1
        ({"completion_window": "soon"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input_file_id": "file_nope"}, "input_file_id"),
    ],
)
def test_batch_create_refusals(client: FlaskClient, tenant, extra, param) -> None:
    _, key = tenant
    f = upload(client, key, jsonl([line(0)])).get_json()
    r = create(client, key, f["id"], **extra)
    assert r.status_code in (400, 404) and r.get_json()["error"]["param"] == param


def test_other_tenants_files_and_batches_are_404(client: FlaskClient, tenant, services) -> None:
    _, key = tenant
    other = services.keys.create_key("tenant-batch-other")
    f = upload(client, key, jsonl([line(0)])).get_json()
    b = create(client, key, f["id"]).get_json()
    for method, path in [
        ("get", f"/v1/files/{f['id']}"),
        ("get", f"/v1/files/{f['id']}/content"),
        ("delete", f"/v1/files/{f['id']}"),
        ("get", f"/v1/batches/{b['id']}"),
        ("post", f"/v1/batches/{b['id']}/cancel"),
        ("post", f"/v1/batches/{b['id']}/retry"),
    ]:
        r = getattr(client, method)(path, headers=auth(other))
        assert r.status_code == 404, (method, path)
    r = create(client, other, f["id"])
    assert r.status_code == 404
    assert b["id"] not in [x["id"] for x in client.get("/v1/batches", headers=auth(other)).get_json()["data"]]


class LazyUpload(io.RawIOBase):
    """A multipart body of `size` bytes of JSONL, made as it is read (never held whole)."""

    BOUNDARY = "llmq-lazy-boundary"

    def __init__(self, size: int) -> None:
        head = (
            f'--{self.BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{self.BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        self._tail = f"\r\n--{self.BOUNDARY}--\r\n".encode()
        self._line = json.dumps(line(0)).encode() + b"\n"
        self.size = size
        self._left = size - len(head) - len(self._tail)
        self._pending = head
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True  # only far enough for the test client to learn the size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self.size if whence == 2 else offset
        return self._pos

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def, override]
        if not self._pending:
            if self._left > 0:
                n = min(self._left, 1 << 16)
                self._pending = (self._line * (n // len(self._line) + 1))[:n]
                self._left -= n
            elif self._tail:
                self._pending, self._tail = self._tail, b""
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        self._pos += n
        return n


def test_an_oversized_upload_is_413_with_flat_memory(client: FlaskClient, tenant, services, settings) -> None:
    import psutil

    name, key = tenant
    body = LazyUpload(settings.max_upload_bytes + 50 * 2**20)
    before = psutil.Process().memory_info().rss
    r = client.post(
        "/v1/files",
        input_stream=body,
        content_length=body.size,
        content_type=f"multipart/form-data; boundary={LazyUpload.BOUNDARY}",
        headers=auth(key),
    )
    grown = psutil.Process().memory_info().rss - before
    assert r.status_code == 413, r.get_data(as_text=True)[:300]
    assert r.get_json()["error"]["type"]
    assert grown < 50 * 2**20, grown
    assert file_count(services, name) == 0


def test_a_line_over_the_line_limit_refuses_the_upload_by_number(stores) -> None:  # type: ignore[no-untyped-def]
    """A one-line file of 199 MB was accepted; each line now has a hard cap (LLMQ_MAX_LINE_BYTES)."""
    from app.api import create_app
    from app.container import build_services
    from tests.helpers import make_settings

    settings = make_settings(stores, max_line_bytes=4096, db_pool_size=2)
    services = build_services(settings)
    try:
        client = create_app(services=services).test_client()
        key = services.keys.create_key("tenant-long-line")
        data = jsonl([line(1), line(2, messages=[{"role": "user", "content": "x" * 5000}]), line(3)])
        r = upload(client, key, data)
        assert r.status_code == 413, r.get_json()
        error = r.get_json()["error"]
        assert "line 2" in error["message"] and error["code"] == "line_too_large"
        assert file_count(services, "tenant-long-line") == 0
        assert upload(client, key, jsonl([line(1), line(3)])).status_code == 200
    finally:
        services.close()
