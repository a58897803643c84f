"""The web console's routes: the files it serves and their Content-Security-Policy, and the
two API routes it reads besides the existing ones, `GET /v2/throughput` (per tenant, from
the job records, through its index) and `GET /v2/jobs/<id>/request`. The console itself runs
in a real browser in tests/integration/test_console.py."""

from __future__ import annotations

import re
import secrets
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import insert, text

from app.api.console import ASSETS
from app.ids import new_id
from app.models import Job
from app.schemas.jobs import JobRequestObject
from app.schemas.throughput import Throughput
from app.services.throughput import ThroughputService
from tests.helpers import auth


def directives(policy: str) -> dict[str, str]:
    return {d.split(" ", 1)[0]: d.split(" ", 1)[1] if " " in d else "" for d in policy.split("; ")}


def check_headers(headers: Any) -> None:
    csp = directives(headers["Content-Security-Policy"])
    assert csp["default-src"] == "'self'"
    assert csp["script-src"] == "'self'" and csp["style-src"] == "'self'"
    assert csp["connect-src"] == "'self'" and csp["object-src"] == "'none'"
    assert csp["frame-ancestors"] == "'none'" and csp["base-uri"] == "'none'"
    assert csp["require-trusted-types-for"] == "'script'"
    # Nothing that would let an inline script or style, eval or another origin in.
    for value in csp.values():
        assert "unsafe" not in value and "*" not in value and "http" not in value
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"


class _Page(HTMLParser):
    """What index.html loads and whether anything in it is inline."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str | None] = []
        self.styles: list[str | None] = []
        self.inline: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "script":
            self.scripts.append(attributes.get("src"))
        if tag == "link" and attributes.get("rel") == "stylesheet":
            self.styles.append(attributes.get("href"))
        if tag == "style":
            self.inline.append("<style>")
        self.inline += [f"{tag}[{name}]" for name in attributes if name == "style" or name.startswith("on")]


def test_the_console_page_and_its_files_are_served_with_a_strict_policy(client: FlaskClient) -> None:
    r = client.get("/console")
    assert r.status_code == 308 and r.headers["Location"].endswith("/console/")
    r = client.get("/console/")
    assert r.status_code == 200 and r.mimetype == "text/html"
    check_headers(r.headers)
    page = _Page()
    page.feed(r.get_data(as_text=True))
    assert page.scripts == ["console.js"] and page.styles == ["console.css"]
    assert page.inline == []
    for name, mimetype in (("console.js", "text/javascript"), ("console.css", "text/css")):
        r = client.get(f"/console/{name}")
        assert r.status_code == 200 and r.mimetype == mimetype, name
        check_headers(r.headers)
        # Revalidated, not re-sent: the ETag answers a 304.
        again = client.get(f"/console/{name}", headers={"If-None-Match": r.headers["ETag"]})
        assert again.status_code == 304
    assert set(ASSETS) == {"index.html", "console.js", "console.css"}


@pytest.mark.parametrize(
    "name", ["nope.js", "index.htm", "__init__.py", "..%2F__init__.py", "..%2F..%2Fsettings.py", "%2e%2e"]
)
def test_only_the_console_files_are_served(client: FlaskClient, name: str) -> None:
    r = client.get(f"/console/{name}")
    assert r.status_code == 404
    assert r.get_json()["error"]["type"] == "not_found_error"
    assert b"import" not in r.get_data()
    if "%2F" not in name:  # a name the console's route takes: its answer carries the policy too
        check_headers(r.headers)


def test_the_script_never_writes_html_nor_puts_the_key_in_a_url(client: FlaskClient) -> None:
    """What the policy enforces in the browser, also read in the source: no HTML sinks, no
    eval, no EventSource (it cannot send the key in a header), the key in sessionStorage only."""
    script = client.get("/console/console.js").get_data(as_text=True)
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in code, sink
    assert "EventSource" not in code and "localStorage" not in code
    assert "sessionStorage" in code
    assert re.search(r"Authorization: `Bearer \$\{key\}`", code)


# --- GET /v2/jobs/<id>/request --------------------------------------------------------------


def test_a_job_request_is_its_tenants_alone(client: FlaskClient, tenant_keys: dict[str, str]) -> None:
    secret = f"prompt-{secrets.token_hex(4)}"
    job = client.post(
        "/v2/jobs",
        json={"model": "api-only", "messages": [{"role": "user", "content": secret}], "max_tokens": 3},
        headers=auth(tenant_keys["a"]),
    ).get_json()
    r = client.get(f"/v2/jobs/{job['id']}/request", headers=auth(tenant_keys["a"]))
    assert r.status_code == 200
    body = JobRequestObject.model_validate(r.get_json())
    assert body.id == job["id"] and body.object == "job.request"
    assert body.body is not None and body.body["messages"][0]["content"] == secret
    assert body.body["max_tokens"] == 3
    r = client.get(f"/v2/jobs/{job['id']}/request", headers=auth(tenant_keys["b"]))
    assert r.status_code == 404 and secret not in r.get_data(as_text=True)
    assert r.get_json()["error"]["param"] == "job_id"


# --- GET /v2/throughput -----------------------------------------------------------------------


def _tenant(services, key: str) -> str:  # type: ignore[no-untyped-def]
    return str(services.keys.authenticate(key).tenant_id)


def _job(
    tenant: str, status: str, ended: datetime | None, completion: int, prompt: int = 7
) -> dict[str, Any]:
    stamp = {f"{status}_at": ended} if ended is not None and status != "running" else {}
    return {
        "id": new_id("job"),
        "tenant_id": tenant,
        "status": status,
        "model": "api-only",
        "request": {"model": "api-only", "messages": [{"role": "user", "content": "x"}]},
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
        "created_at": (ended or datetime.now(UTC)) - timedelta(seconds=30),
        "started_at": (ended or datetime.now(UTC)) - timedelta(seconds=20),
        **stamp,
    }


@pytest.fixture
def two_tenants(services) -> tuple[str, str, str, str]:  # type: ignore[no-untyped-def]
    a = services.keys.create_key(f"tenant-tp-a-{secrets.token_hex(3)}")
    b = services.keys.create_key(f"tenant-tp-b-{secrets.token_hex(3)}")
    return a, b, _tenant(services, a), _tenant(services, b)


def test_throughput_counts_the_tenants_ended_jobs_per_bucket(services, two_tenants) -> None:  # type: ignore[no-untyped-def]
    key_a, key_b, a, b = two_tenants
    # Fixed "now", 30 s into a minute: the current bucket is 30 s old.
    now = datetime(2026, 12, 1, 12, 0, 30, tzinfo=UTC)
    minute = now.replace(second=0)
    rows = [
        _job(a, "succeeded", minute - timedelta(seconds=50), 600),  # previous bucket
        _job(a, "succeeded", minute - timedelta(seconds=10), 120),  # previous bucket
        _job(a, "failed", minute - timedelta(seconds=5), 0),  # previous bucket
        _job(a, "succeeded", minute + timedelta(seconds=10), 90),  # current bucket
        _job(a, "cancelled", minute + timedelta(seconds=20), 30),  # current bucket
        _job(a, "succeeded", minute - timedelta(minutes=30), 1000),  # half an hour ago
        _job(a, "succeeded", minute - timedelta(minutes=61), 5000),  # before the window
        _job(a, "running", None, 0),  # not ended: not counted
        _job(b, "succeeded", minute - timedelta(seconds=20), 777),  # tenant B's
    ]
    with services.db.session() as s:
        s.execute(insert(Job), rows)
    service = ThroughputService(services.db, clock=lambda: now)

    mine = service.read(services.keys.authenticate(key_a), window_seconds=3600, bucket_seconds=60)
    assert mine.bucket_seconds == 60 and len(mine.data) == 60
    assert mine.data[-1].start == int(minute.timestamp()) and mine.start == mine.data[0].start
    assert mine.end == int(now.timestamp())
    assert [d.start for d in mine.data] == list(range(mine.start, mine.data[-1].start + 1, 60))
    current, previous = mine.data[-1], mine.data[-2]
    assert (current.succeeded, current.cancelled, current.completion_tokens) == (1, 1, 120)
    assert current.output_tokens_per_second == 4.0  # 120 tokens over the 30 s gone
    assert (previous.succeeded, previous.failed, previous.completion_tokens) == (2, 1, 720)
    assert previous.prompt_tokens == 21 and previous.output_tokens_per_second == 12.0
    half_hour = next(d for d in mine.data if d.start == int((minute - timedelta(minutes=30)).timestamp()))
    assert half_hour.completion_tokens == 1000
    assert sum(d.completion_tokens for d in mine.data) == 600 + 120 + 90 + 30 + 1000

    theirs = service.read(services.keys.authenticate(key_b), window_seconds=3600, bucket_seconds=60)
    assert sum(d.completion_tokens for d in theirs.data) == 777
    assert sum(d.succeeded for d in theirs.data) == 1

    wide = service.read(services.keys.authenticate(key_a), window_seconds=7200, bucket_seconds=600)
    assert len(wide.data) == 12 and sum(d.completion_tokens for d in wide.data) == 6840
    # A window that is not whole buckets is rounded up to them.
    odd = service.read(services.keys.authenticate(key_a), window_seconds=150, bucket_seconds=60)
    assert len(odd.data) == 3 and sum(d.completion_tokens for d in odd.data) == 840


def test_throughput_route_is_tenant_scoped_and_bounded(client: FlaskClient, services, two_tenants) -> None:  # type: ignore[no-untyped-def]
    key_a, key_b, a, _ = two_tenants
    ended = datetime.now(UTC) - timedelta(seconds=5)
    with services.db.session() as s:
        s.execute(insert(Job), [_job(a, "succeeded", ended, 321)])
    r = client.get("/v2/throughput", headers=auth(key_a))
    assert r.status_code == 200
    figures = Throughput.model_validate(r.get_json())
    assert figures.object == "throughput" and len(figures.data) == 60 and figures.bucket_seconds == 60
    assert sum(d.completion_tokens for d in figures.data) == 321
    other = Throughput.model_validate(client.get("/v2/throughput", headers=auth(key_b)).get_json())
    assert sum(d.completion_tokens + d.succeeded for d in other.data) == 0
    assert client.get("/v2/throughput").status_code == 401
    for query, param in (
        ("bucket_seconds=10", "bucket_seconds"),
        ("bucket_seconds=abc", "bucket_seconds"),
        ("bucket_seconds=7200", "bucket_seconds"),
        ("window_seconds=90000", "window_seconds"),
        ("window_seconds=30", "window_seconds"),
        ("window_seconds=", "window_seconds"),
    ):
        r = client.get(f"/v2/throughput?{query}", headers=auth(key_a))
        assert r.status_code == 400, query
        assert r.get_json()["error"]["param"] == param, query


def test_throughput_reads_through_its_index(services, two_tenants) -> None:  # type: ignore[no-untyped-def]
    """The query's expression and predicate match `ix_jobs_tenant_ended` word for word, so
    an hour of a tenant's jobs is a range scan of it (seq scans off: the table is small)."""
    from app.services.throughput import _BUCKETS

    _, _, a, _ = two_tenants
    now = datetime.now(UTC)
    with services.db.session() as s:
        s.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(
            row[0]
            for row in s.execute(
                text(f"EXPLAIN {_BUCKETS.text}"),
                {"tenant": a, "bucket": 60, "start": now - timedelta(hours=1), "end": now},
            )
        )
    assert "ix_jobs_tenant_ended" in plan, plan
