"""Every knob is a Settings field; a mistyped `LLMQ_` name is reported, not ignored."""

from __future__ import annotations

import logging

import pytest

from app import logs
from app.settings import Settings, unknown_environment


def test_unknown_llmq_names_are_found_and_known_ones_are_not() -> None:
    environ = {
        "LLMQ_MAX_NUM_SEQS": "8",
        "LLMQ_MAX_NUM_SEQ": "8",  # the typo
        "LLMQ_DATABSE_URL": "postgresql://x",
        "LLMQ_TEST_PG_URL": "postgresql://y",  # the test suite's own knob
        "PATH": "/bin",
    }
    assert unknown_environment(environ) == ["LLMQ_DATABSE_URL", "LLMQ_MAX_NUM_SEQ"]


def test_the_cli_and_llmq_up_knobs_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    names = {
        "LLMQ_URL": "http://h:1",
        "LLMQ_API_KEY": "k",
        "LLMQ_API_WORKERS": "3",
        "LLMQ_EMBEDDED_PG_PORT": "5555",
        "LLMQ_EMBEDDED_REDIS_PORT": "6666",
        "LLMQ_EMBEDDED_PG_OS_USER": "postgres",
        "LLMQ_DATA_DIR": "/tmp/d",
    }
    assert unknown_environment(names) == []
    for name, value in names.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PORT", "9001")
    s = Settings()
    assert (s.url, s.api_key, s.api_workers, s.embedded_pg_port, s.embedded_redis_port) == (
        "http://h:1",
        "k",
        3,
        5555,
        6666,
    )
    assert s.embedded_pg_os_user == "postgres" and str(s.data_dir) == "/tmp/d" and s.port == 9001


def test_configuring_logs_warns_about_unknown_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.setenv("LLMQ_MAX_TOKEN_LIMIT", "5")
    monkeypatch.setattr(root, "_llmq_configured", False, raising=False)
    try:
        logs.configure_logging(Settings())
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "unknown LLMQ_ variables ignored (a typo?): LLMQ_MAX_TOKEN_LIMIT" in capsys.readouterr().err
