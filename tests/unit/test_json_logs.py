"""With `LLMQ_LOG_JSON`, every logger a process has writes llmq's JSON lines with millisecond
timestamps: llmq's own, vLLM's (as vLLM configures itself, from the environment, in each
of its processes), Celery's (its task logger included), gunicorn's, Python warnings, and,
in a worker, whatever bypasses logging (C++ warnings, progress bars, prints, children's
output).

Each case runs in a fresh interpreter: logging is process-wide state, and what is tested is
how a process starts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from app.logs import JsonFormatter, timestamp

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MS_TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def run(code: str, *, strict: bool = True, **env: str) -> list[dict[str, Any]]:
    """Run `code` in a new interpreter with JSON logs on; its stderr and stdout, each line
    parsed as JSON (a line that is not JSON fails the test; `strict=False` skips it)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMQ_", "VLLM_"))}
    full_env.update({"LLMQ_LOG_JSON": "true", "PYTHONPATH": ROOT, **env})
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    records = []
    for stream in (done.stderr, done.stdout):
        for raw in stream.decode().splitlines():
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                if not strict:
                    continue
                pytest.fail(f"not a JSON line: {raw!r}")
            assert isinstance(record, dict), raw
            assert MS_TIMESTAMP.fullmatch(record["ts"]), raw
            assert {"level", "logger", "msg", "pid"} <= set(record), raw
            records.append(record)
    return records


def by_logger(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for r in records:
        out.setdefault(r["logger"], []).append(r["msg"])
    return out


def test_timestamps_are_utc_to_the_millisecond() -> None:
    assert timestamp(0) == "1970-01-01T00:00:00.000Z"
    assert timestamp(1_798_761_600.1234) == "2027-01-01T00:00:00.123Z"
    import logging

    record = logging.makeLogRecord({"name": "x", "msg": "m", "levelname": "INFO"})
    assert MS_TIMESTAMP.fullmatch(json.loads(JsonFormatter().format(record))["ts"])


def test_llmq_libraries_and_warnings_write_json_lines() -> None:
    records = run(
        """
        import logging, warnings
        from app.logs import configure_logging
        from app.settings import Settings
        configure_logging(Settings())
        logging.getLogger("llmq.test").info("own line", extra={"job_id": "job_1"})
        logging.getLogger().warning("root line")
        logging.getLogger("vllm.engine").info("vllm line")
        # a library that gave itself a handler of its own before llmq configured logging
        from celery.utils.log import get_task_logger
        get_task_logger("t").warning("celery task line")
        warnings.warn("a warning")
        """
    )
    lines = by_logger(records)
    assert lines["llmq.test"] == ["own line"]
    assert lines["root"] == ["root line"]
    assert lines["vllm.engine"] == ["vllm line"]
    assert lines["t"] == ["celery task line"]
    assert any("UserWarning: a warning" in m for m in lines["py.warnings"])
    assert next(r for r in records if r["logger"] == "llmq.test")["job_id"] == "job_1"


def test_vllm_configures_its_processes_with_llmqs_json_from_the_environment() -> None:
    """What vLLM's engine core does at start (`configure_logging(LoggingConfig())`, whose
    fields come from the environment alone) in a process where llmq configured nothing.
    Not strict: importing vLLM prints a line of its own (a worker wraps those, see the last
    test)."""
    records = run(
        """
        import os, subprocess, sys
        from app.logs import vllm_logging_environment
        from app.settings import Settings
        env = {**os.environ, **vllm_logging_environment(Settings())}
        child = '''
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging, init_logger
        configure_logging(LoggingConfig())
        init_logger("vllm.v1.engine.core").info("engine core line")
        '''
        import textwrap
        subprocess.run([sys.executable, "-c", textwrap.dedent(child)], env=env, check=True)
        """,
        strict=False,
    )
    assert "engine core line" in by_logger(records)["vllm.v1.engine.core"]


def test_an_operators_own_vllm_logging_settings_win() -> None:
    env = {"VLLM_LOGGING_CONFIG_PATH": "/etc/their.json"}
    code = (
        "import os\nfrom app.logs import vllm_logging_environment\nfrom app.settings import Settings\n"
        "assert vllm_logging_environment(Settings()) == {}\n"
    )
    assert run(code, **env) == []


def test_celerys_logging_setup_leaves_llmqs_in_place() -> None:
    """Celery's worker sets logging up at start; with llmq's receiver on `setup_logging`
    it adds no handler (its task logger's included) and redirects nothing."""
    records = run(
        """
        import logging, sys
        from celery.utils.log import get_task_logger
        from app.logs import configure_logging
        from app.settings import Settings
        from worker.celery_app import create_celery
        settings = Settings(redis_url="redis://127.0.0.1:1/0", model="m")
        configure_logging(settings)
        app = create_celery(settings)
        app.log.setup(loglevel="INFO", redirect_stdouts=True)
        get_task_logger("worker.tasks").info("task line")
        logging.getLogger("celery.worker.consumer").info("consumer line")
        assert sys.stdout is sys.__stdout__  # not redirected into a logger
        """
    )
    lines = by_logger(records)
    assert lines["worker.tasks"] == ["task line"]
    assert lines["celery.worker.consumer"] == ["consumer line"]


def test_gunicorns_own_lines_are_llmqs_json() -> None:
    records = run(
        """
        from gunicorn.config import Config
        from app.gunicorn_logging import Logger
        cfg = Config()
        cfg.set("loglevel", "info")
        log = Logger(cfg)
        log.info("Booting worker with pid: %s", 42)
        log.error("Worker timeout")
        """
    )
    assert by_logger(records)["gunicorn.error"] == ["Booting worker with pid: 42", "Worker timeout"]


def test_a_json_workers_raw_output_becomes_json() -> None:
    """What bypasses logging in a worker: C-level writes to fd 2, prints, a progress bar's
    `\\r` redraws, a child process's output; records pass through unchanged."""
    records = run(
        """
        import logging, os, subprocess, sys
        from worker.stdio import capture_output
        from app.logs import configure_logging
        from app.settings import Settings
        capture_output()
        configure_logging(Settings())
        logging.getLogger("llmq.test").info("a record")
        os.write(2, b"[W1201 utils.cpp:68] Warning: from C++\\n")
        print("a print")
        sys.stderr.write("Loading 0%\\rLoading 100%\\n")
        subprocess.run(["echo", "from a child"], check=True)
        sys.stdout.write("no newline at exit")
        """
    )
    lines = by_logger(records)
    assert lines["llmq.test"] == ["a record"]
    assert lines["stderr"] == ["[W1201 utils.cpp:68] Warning: from C++", "Loading 100%"]
    assert lines["stdout"] == ["a print", "from a child", "no newline at exit"]
