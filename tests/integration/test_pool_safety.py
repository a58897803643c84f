"""X10 under the real server: the API under gunicorn with gevent workers and a small
database pool, attacked with unread downloads and a burst of SSE streams, while another
tenant's calls must keep answering. Starts no worker and no engine."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text

from app.container import Services
from tests.helpers import ApiProcess, Stores, stack_env

pytestmark = pytest.mark.api_process

LINES = 2000
LINE_BYTES = 8000  # 16 MB: far more than the socket buffers of a client that never reads


@pytest.fixture(scope="module")
def api(stores: Stores, logs_dir: Path) -> Iterator[ApiProcess]:
    env = stack_env(
        stores,
        Path("api-only"),
        "api-only",
        LLMQ_DB_POOL_SIZE="2",  # 2 workers x (2 + 4 overflow): 12 connections in all
        LLMQ_DB_POOL_TIMEOUT_SECONDS="3",
        LLMQ_MAX_STREAMS_PER_KEY="0",  # no cap: the pool itself must hold
        LLMQ_SSE_HEARTBEAT_SECONDS="5",
    )
    process = ApiProcess(env, logs_dir / "api-pool-safety.log")
    yield process
    process.stop()


def big_file(services: Services, tenant: str) -> str:
    """A 16 MB input file written straight into Postgres (uploading it would only test the
    upload)."""
    file_id = f"file_{secrets.token_hex(8)}"
    with services.db.session() as s:
        s.execute(
            text(
                "INSERT INTO files (id, tenant_id, purpose, filename, bytes, line_count, created_at) "
                "VALUES (:id, :t, 'batch', 'big.jsonl', :b, :n, :now)"
            ),
            {"id": file_id, "t": tenant, "b": LINES * LINE_BYTES, "n": LINES, "now": datetime.now(UTC)},
        )
        s.execute(
            text(
                "INSERT INTO file_lines (file_id, line_no, custom_id, raw) "
                'SELECT :id, i, \'req-\' || i, \'{"custom_id": "req-\' || i || \'", "pad": "\' '
                "|| repeat('x', :pad) || '\"}' FROM generate_series(1, :n) AS i"
            ),
            {"id": file_id, "n": LINES, "pad": LINE_BYTES},
        )
    return file_id


def open_unread(url: str, path: str, key: str, count: int) -> list[socket.socket]:
    """`count` requests whose bodies are never read: each socket reads only its status
    line (so the server has begun the response), then sits there."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode())
        socks.append(sock)
    return socks


def status_line(sock: socket.socket, timeout: float) -> str:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        more = sock.recv(1)
        if not more:
            break
        data += more
    return data.decode("latin-1").strip()


def other_tenants_calls(url: str, key: str, calls: int) -> list[tuple[int, float]]:
    """(status, seconds) of each call, every one allowed 5 s at most."""
    results = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=5) as client:
        for i in range(calls):
            started = time.monotonic()
            try:
                if i % 2:
                    r = client.get("/v2/jobs")
                else:
                    body = {
                        "model": "api-only",
                        "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 2,
                    }
                    r = client.post("/v2/jobs", json=body)
                results.append((r.status_code, time.monotonic() - started))
            except httpx.TimeoutException:
                results.append((0, time.monotonic() - started))
    return results


def test_sixty_unread_downloads_leave_other_tenants_served(api: ApiProcess, services: Services) -> None:
    attacker_tenant = f"tenant-attacker-{secrets.token_hex(3)}"
    attacker = services.keys.create_key(attacker_tenant)
    victim = services.keys.create_key(f"tenant-victim-{secrets.token_hex(3)}")
    file_id = big_file(services, attacker_tenant)

    socks = open_unread(api.url, f"/v1/files/{file_id}/content", attacker, 60)
    try:
        started = time.monotonic()
        statuses = [status_line(s, 30) for s in socks]
        waited = round(time.monotonic() - started, 2)  # until the last status line
        refused = [s for s in statuses if " 200 " not in s + " "]
        assert not refused, (refused, waited, api.warnings())
        results = other_tenants_calls(api.url, victim, 20)
        assert all(200 <= status < 300 for status, _ in results), results
        assert max(seconds for _, seconds in results) < 5, results
    finally:
        for s in socks:
            s.close()


def test_a_burst_of_six_hundred_streams_is_never_a_500(api: ApiProcess, services: Services) -> None:
    tenant = f"tenant-burst-{secrets.token_hex(3)}"
    key = services.keys.create_key(tenant)
    victim = services.keys.create_key(f"tenant-victim-{secrets.token_hex(3)}")
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as client:
        body = {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        job_id = client.post("/v2/jobs", json=body).json()["id"]

    socks = open_unread(api.url, f"/v2/jobs/{job_id}/stream", key, 600)
    try:
        statuses = [status_line(s, 60) for s in socks]
        codes = [s.split(" ")[1] if " " in s else s for s in statuses]
        assert not [c for c in codes if c.startswith("5") and c != "503"], sorted(set(codes))
        assert codes.count("200") >= 590, sorted(set(codes))
        results = other_tenants_calls(api.url, victim, 20)
        assert all(200 <= status < 300 for status, _ in results), results
    finally:
        for s in socks:
            s.close()
