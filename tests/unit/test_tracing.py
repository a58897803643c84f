"""Tracing's switch and exporters (the trace itself: tests/integration/test_tracing.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from app import tracing
from app.settings import Settings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_off_by_default_and_then_spans_do_nothing() -> None:
    assert Settings().otel is False
    assert tracing.setup(Settings(), service="llmq-test") is None
    span = tracing.start_span(tracing.ENGINE_SPAN, {"llmq.job_id": "job_1"})
    span.end(RuntimeError("nothing to record"))


def test_the_dev_extra_installs_the_otel_extra_so_ci_runs_the_trace_test() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["otel"] and set(extras["otel"]) <= set(extras["dev"])


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("LLMQ_", "OTEL_"))}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**full, "PYTHONPATH": str(ROOT), "LLMQ_OTEL": "true", **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_standard_otel_variables_choose_the_exporter_and_the_service_name() -> None:
    done = run(
        """
        from opentelemetry import trace
        from app import tracing
        from app.settings import Settings
        provider = tracing.setup(Settings(), service="llmq-worker")
        assert trace.get_tracer_provider() is provider
        assert provider.resource.attributes["service.name"] == "billing-llmq"
        tracing.start_span(tracing.ENGINE_SPAN, {"llmq.job_id": "job_1"}).end()
        provider.shutdown()
        """,
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="billing-llmq",
    )
    assert done.returncode == 0, done.stderr
    assert '"name": "llmq.engine.generate"' in done.stdout and '"llmq.job_id": "job_1"' in done.stdout


def test_an_exporter_llmq_does_not_ship_is_refused_at_start() -> None:
    done = run(
        "from app import tracing\nfrom app.settings import Settings\n"
        "tracing.setup(Settings(), service='llmq-api')\n",
        OTEL_TRACES_EXPORTER="zipkin",
    )
    assert done.returncode != 0 and "OTEL_TRACES_EXPORTER='zipkin'" in done.stderr
