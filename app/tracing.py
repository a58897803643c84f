"""OpenTelemetry traces, with the optional `otel` extra and `LLMQ_OTEL=true`.

One trace follows a request from HTTP through the queue to the engine: Flask's server span
for the request, SQLAlchemy's and Redis's client spans for what it does, Celery's publish
span, whose context travels in the message's headers; in the worker, Celery's task span
continues that trace, and the runner's `llmq.engine.generate` span (attributes
`llmq.job_id`, `llmq.epoch`, `llmq.request_id`) times the job's generation in the engine
under it. (A batch's lines are sent by the feeder, not by a request: each line's trace
starts at its worker's task.)

Where spans go follows OpenTelemetry's own environment variables, as an operator of any
instrumented service expects: `OTEL_TRACES_EXPORTER` (`otlp`, the default; `console`;
`none`), `OTEL_EXPORTER_OTLP_ENDPOINT` and `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf`,
the default, or `grpc`), `OTEL_SERVICE_NAME` (else `llmq-api`, `llmq-worker`),
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, `OTEL_SDK_DISABLED`.

Without `LLMQ_OTEL` nothing here imports OpenTelemetry, and `start_span` hands out a span
that does nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from app.settings import Settings

ENGINE_SPAN = "llmq.engine.generate"
_lock = threading.Lock()
_provider: Any = None  # the process's TracerProvider, once set up
_tracer: Any = None


class Span:
    """A span that does nothing: what `start_span` returns while tracing is off."""

    def end(self, error: BaseException | None = None) -> None:
        return None


class _OtelSpan(Span):
    def __init__(self, span: Any) -> None:
        self._span = span

    def end(self, error: BaseException | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            self._span.record_exception(error)
            self._span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        self._span.end()


def setup(settings: Settings, *, service: str, provider: Any = None) -> Any:
    """Turn tracing on in this process (once; later calls return the first provider):
    Celery, Redis and SQLAlchemy are instrumented from here on, so call this before the
    process creates its database engine. `provider`: a TracerProvider of the caller's (a
    test's in-memory exporter); else one that exports as the OTEL_* variables say.

    Returns the TracerProvider, or None while `LLMQ_OTEL` is off.

    Raises:
        RuntimeError: `LLMQ_OTEL` is on and the `otel` extra is not installed.
    """
    global _provider, _tracer
    if not settings.otel:
        return None
    with _lock:
        if _provider is not None:
            return _provider
        try:
            from opentelemetry.instrumentation.celery import CeleryInstrumentor
            from opentelemetry.instrumentation.redis import RedisInstrumentor
            from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor
        except ImportError as exc:
            raise RuntimeError(
                "LLMQ_OTEL is on but OpenTelemetry is not installed: pip install 'llmq[otel]'"
            ) from exc
        provider = provider if provider is not None else _exporting_provider(service)
        CeleryInstrumentor().instrument(tracer_provider=provider)
        RedisInstrumentor().instrument(tracer_provider=provider)
        # Its declared range stops below SQLAlchemy 2.1; the engine events it uses are the
        # same in 2.1 (tests/integration/test_tracing.py sees the statements' spans).
        SQLAlchemyInstrumentor().instrument(tracer_provider=provider, skip_dep_check=True)
        _provider = provider
        _tracer = provider.get_tracer("llmq")
        return provider


def enabled() -> bool:
    """Whether this process traces (`setup` ran with `LLMQ_OTEL` on)."""
    return _provider is not None


def instrument_app(app: Any) -> None:
    """Server spans for each request of the Flask `app` (after `setup`; else nothing)."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    FlaskInstrumentor().instrument_app(app, tracer_provider=_provider)


def start_span(name: str, attributes: dict[str, Any]) -> Span:
    """A span that starts now, as a child of this thread's current span (the Celery task's
    in a worker's task thread); end it from any thread."""
    if _tracer is None:
        return Span()
    clean = {k: v for k, v in attributes.items() if v is not None}
    return _OtelSpan(_tracer.start_span(name, attributes=clean))


def teardown() -> None:
    """Undo `setup` (tests): the instrumentations come off and spans stop."""
    global _provider, _tracer
    with _lock:
        if _provider is None:
            return
        from opentelemetry.instrumentation.celery import CeleryInstrumentor
        from opentelemetry.instrumentation.redis import RedisInstrumentor
        from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

        for instrumentor in (CeleryInstrumentor(), RedisInstrumentor(), SQLAlchemyInstrumentor()):
            instrumentor.uninstrument()
        _provider = _tracer = None


def _exporting_provider(service: str) -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # OTEL_SERVICE_NAME, when set, names the service (Resource.create reads it; attributes
    # passed here would override it).
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
    provider = TracerProvider(resource=Resource.create(attributes))
    for listed in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(","):
        name = listed.strip().lower()
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif name not in ("none", ""):
            raise RuntimeError(f"OTEL_TRACES_EXPORTER={name!r}: llmq exports otlp, console or none")
    trace.set_tracer_provider(provider)
    return provider


def _otlp_exporter() -> Any:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[assignment]
            OTLPSpanExporter,
        )
    return OTLPSpanExporter()
