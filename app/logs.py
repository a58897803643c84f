"""Structured logging: every line carries its context fields (job id, batch id, tenant).

Prompts and API keys never go into a log record at INFO; as a second line of defence, the
formatter masks anything shaped like an llmq key.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any

from app.settings import Settings, unknown_environment

_KEY_PATTERN = re.compile(r"llmq-[A-Za-z0-9_\-]{8,}")
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


def _mask(text: str) -> str:
    return _KEY_PATTERN.sub("llmq-***", text)


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(record).items()
        if k not in _STANDARD and not k.startswith(("_", "vllm_")) and k != "data"
    }


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in _context(record).items())
        return _mask(f"{base} {extras}" if extras else base)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_context(record),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return _mask(json.dumps(payload, default=str))


def configure_logging(settings: Settings) -> None:
    """Idempotent: safe to call from every process entry point."""
    root = logging.getLogger()
    if getattr(root, "_llmq_configured", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if settings.log_json
        else KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    for noisy in ("urllib3", "werkzeug", "kombu", "amqp", "httpx", "httpcore", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    root._llmq_configured = True  # type: ignore[attr-defined]
    unknown = unknown_environment(os.environ)
    if unknown:
        logging.getLogger("llmq.settings").warning(
            "unknown LLMQ_ variables ignored (a typo?): %s", ", ".join(unknown)
        )
