"""OpenTelemetry (issue 14, item 4): with `LLMQ_OTEL` on, one trace runs from the HTTP
request through the queue to the engine.

The API (its Flask app, with its services, database engine and Redis client built by
`create_app`) and a real Celery worker (a threads pool consuming a real Redis broker, with
the worker runtime `create_celery` builds at `worker_init`) run in this process, so one
in-memory span exporter sees the spans of both: the request's server span, its SQLAlchemy,
Redis and Celery publish spans, then, across the broker, the worker's task span and the
engine span of the job, all under one trace id. The engine is the instant one: what is
traced is llmq's path around the engine call, not the engine.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.contrib.testing.worker import start_worker
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from app import tracing
from app.api import create_app
from app.cli.embedded import free_port, redis_start
from app.connections import ADMIN_POOL
from app.db import Database
from app.services.keys import KeyService
from tests.helpers import Stores, auth, fresh_database, make_settings
from worker import runtime
from worker.celery_app import create_celery

pytestmark = pytest.mark.integration

MODEL = "trace-instant"


@pytest.fixture
def traced() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    """An in-memory exporter behind a provider of the test's; tracing off again after."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    tracing.teardown()
    provider.shutdown()


def test_one_trace_from_the_http_request_to_the_engine(
    stores: Stores, traced: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    exporter, provider = traced
    data = Path(tempfile.mkdtemp(prefix="llmq-trace-"))
    redis_server = redis_start(data, free_port(56900), persistent=False)
    # Its own database and Redis: no other worker takes this test's message.
    own = Stores(fresh_database(stores), redis_server.url)
    settings = make_settings(
        own,
        model=MODEL,
        served_model_name=MODEL,
        engine="instant",
        models=MODEL,
        otel=True,
        lease_seconds=6,
        worker_heartbeat_seconds=1,
        max_num_seqs=4,
    )
    assert tracing.setup(settings, service="llmq-test", provider=provider) is provider
    app = create_app(settings)
    celery = create_celery(settings)
    db = Database.from_url(own.database_url, ADMIN_POOL)
    key = KeyService(db).create_key("tenant-trace")
    db.dispose()
    client = app.test_client()
    try:
        with start_worker(
            celery, pool="threads", concurrency=4, perform_ping_check=False, shutdown_timeout=20
        ):
            r = client.post(
                "/v2/jobs",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                headers=auth(key),
            )
            assert r.status_code == 202, r.get_json()
            job_id = r.get_json()["id"]
            deadline = time.monotonic() + 60
            while client.get(f"/v2/jobs/{job_id}", headers=auth(key)).get_json()["status"] != "succeeded":
                assert time.monotonic() < deadline, "the job did not succeed"
                time.sleep(0.2)
            engine = wait_for_span(
                exporter, lambda s: s.name == tracing.ENGINE_SPAN and attr(s, "llmq.job_id") == job_id
            )
    finally:
        rt = runtime.current()
        if rt is not None:
            rt.stop()
            runtime.set_current(None)
        redis_server.stop()

    spans = exporter.get_finished_spans()
    request = next(s for s in spans if s.kind == SpanKind.SERVER and attr(s, "http.route") == "/v2/jobs")
    trace_id = request.context.trace_id
    assert engine.context.trace_id == trace_id
    assert attr(engine, "llmq.request_id") == r.headers["X-Request-ID"]
    # The engine span descends from the request span through the queue: publish → task.
    by_id = {s.context.span_id: s for s in spans}
    chain = []
    node: ReadableSpan | None = engine
    while node is not None and node.parent is not None:
        node = by_id.get(node.parent.span_id)
        if node is not None:
            chain.append(node)
    assert request in chain, [s.name for s in chain]
    kinds = {s.kind for s in chain}
    assert SpanKind.CONSUMER in kinds and SpanKind.PRODUCER in kinds, [(s.name, s.kind) for s in chain]
    # The request's own work is traced too: its database statements and its Redis calls.
    in_trace = [s for s in spans if s.context.trace_id == trace_id]
    assert any(
        attr(s, "db.system") == "postgresql" or attr(s, "db.system.name") == "postgresql" for s in in_trace
    )
    assert any(attr(s, "db.system") == "redis" or attr(s, "db.system.name") == "redis" for s in in_trace)


def attr(span: ReadableSpan, name: str) -> Any:
    return (span.attributes or {}).get(name)


def wait_for_span(exporter: InMemorySpanExporter, match: Any, timeout: float = 10) -> ReadableSpan:
    deadline = time.monotonic() + timeout
    while True:
        found = [s for s in exporter.get_finished_spans() if match(s)]
        if found:
            return found[0]
        assert time.monotonic() < deadline, "no such span"
        time.sleep(0.1)
