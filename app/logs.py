"""Structured logging: every line carries its context fields (job id, batch id, tenant).

Prompts and API keys never go into a log record at INFO; as a second line of defence, the
formatter masks the row values Postgres quotes in its errors (the engine is built with
hide_parameters, so SQLAlchemy adds none) and secrets whatever their shape: the value
after `Bearer`/`Basic` or an `Authorization` header, the value of any key-, token-,
secret- or password-named field (`key=...`, `"api_key": "..."`, an `extra` field so
named), a URL's password, keys of known shapes (`llmq-...`, `sk-...`), and every key this
process registered or was given (see `remember_secret`: the bootstrap key, keys created
or authenticated here).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from typing import Any

from app.request_ids import RequestIdFilter
from app.settings import Settings, unknown_environment

_MASK = "***"
_SENSITIVE_WORDS = r"(?:api[_-]?key|key|secret|token|password|passwd|credential)"
_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # `Bearer <token>`, `Basic <credentials>`, whatever the header's casing.
    (re.compile(r"(?i)\b(bearer)\s+[^\s\\\"',;}]+"), r"\1 " + _MASK),
    (re.compile(r"(?i)\b(basic)\s+[A-Za-z0-9+/]{8,}={0,2}"), r"\1 " + _MASK),
    # An Authorization header whose value has no scheme word.
    (
        re.compile(
            r"(?i)(\bauthorization(?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?!bearer\b|basic\b)[^\s\\\"',;}]+"
        ),
        r"\1" + _MASK,
    ),
    # `key=value`, `api_key: value`, `"token": "value"`, `x_secret=value` ...
    (
        re.compile(
            r"(?i)((?<![a-z0-9])[a-z0-9_\-]*"
            + _SENSITIVE_WORDS
            + r"(?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?!\*\*\*)[^\s\\\"',;&}]+"
        ),
        r"\1" + _MASK,
    ),
    # A password in a URL: scheme://user:password@host.
    (re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1" + _MASK + "@"),
    # Postgres puts values into its diagnostics, whatever the client's hide_parameters:
    # the failing row of a constraint (a job's request with its prompt, a key's prefix),
    # the line a COPY was at (a batch line), a duplicate key's value, rejected input.
    (re.compile(r"(Failing row contains )\([^\n]*"), r"\1(" + _MASK + ")"),
    (re.compile(r"(COPY [^,\n]+, line \d+(?:, column [^:\n]+)?): [^\n]*"), r"\1: " + _MASK),
    (re.compile(r"(JSON data, line \d+: )[^\n]*"), r"\1" + _MASK),
    (re.compile(r"(Key \([^)\n]*\)=)\([^\n]*"), r"\1(" + _MASK + ")"),
    (re.compile(r"(Token )\"[^\n]*\"( is invalid)"), r"\1" + _MASK + r"\2"),
    (re.compile(r"(invalid input (?:syntax|value) for [^:\n]+: )[^\n]*"), r"\1" + _MASK),
    # Keys of known shapes, wherever they stand.
    (re.compile(r"\bllmq-[A-Za-z0-9_\-]{8,}"), "llmq-" + _MASK),
    (re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}"), "sk-" + _MASK),
]
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_SENSITIVE_FIELD = re.compile(r"(?i)" + _SENSITIVE_WORDS + r"$|^authorization$")

# Exact secrets this process knows (bounded: a process registers a handful of keys).
_SECRETS: set[str] = set()
_SECRETS_LONGEST_FIRST: tuple[str, ...] = ()
_SECRETS_LOCK = threading.Lock()
_MAX_SECRETS = 1024
_MIN_SECRET_LENGTH = 8


def remember_secret(secret: str | None) -> None:
    """Mask `secret` in every log line this process writes from now on, whatever its shape."""
    if not secret or len(secret) < _MIN_SECRET_LENGTH:
        return
    global _SECRETS_LONGEST_FIRST
    with _SECRETS_LOCK:
        if secret in _SECRETS or len(_SECRETS) >= _MAX_SECRETS:
            return
        _SECRETS.add(secret)
        _SECRETS_LONGEST_FIRST = tuple(sorted(_SECRETS, key=len, reverse=True))


def mask_secrets(text: str) -> str:
    """`text` with every secret it holds replaced by `***` (see the module docstring)."""
    for secret in _SECRETS_LONGEST_FIRST:
        if secret in text:
            text = text.replace(secret, _MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


_mask = mask_secrets


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: _MASK if _SENSITIVE_FIELD.search(k) else v
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
    remember_secret(settings.bootstrap_api_key)
    root = logging.getLogger()
    if getattr(root, "_llmq_configured", False):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())  # on the handler: it sees every logger's records
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
