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

import atexit
import contextlib
import json
import logging
import logging.config
import os
import re
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.request_ids import RequestIdFilter
from app.settings import Settings, unknown_environment

_MASK = "***"
_SENSITIVE_WORDS = r"(?:api[_-]?key|key|secret|token|password|passwd|credential)"
# Each pattern after its gate: text that a line must hold (one of the strings, or a match of
# the expression), lower-cased as `mask_secrets` folds it, for the pattern to match at all.
# A line that fails the gate skips the pattern. Most lines hold none of them, and running
# every pattern over every line took 44 of a log line's 51 µs of formatting (now 12).
_PATTERNS: list[tuple[tuple[str, ...] | re.Pattern[str], re.Pattern[str], str]] = [
    # `Bearer <token>`, `Basic <credentials>`, whatever the header's casing.
    (("bearer",), re.compile(r"(?i)\b(bearer)\s+[^\s\\\"',;}]+"), r"\1 " + _MASK),
    (("basic",), re.compile(r"(?i)\b(basic)\s+[A-Za-z0-9+/]{8,}={0,2}"), r"\1 " + _MASK),
    # An Authorization header whose value has no scheme word.
    (
        ("authorization",),
        re.compile(
            r"(?i)(\bauthorization(?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?!bearer\b|basic\b)[^\s\\\"',;}]+"
        ),
        r"\1" + _MASK,
    ),
    # `key=value`, `api_key: value`, `"token": "value"`, `x_secret=value` ...
    (
        re.compile(_SENSITIVE_WORDS + r"(?:\\?[\"'])?\s*[:=]"),
        re.compile(
            r"(?i)((?<![a-z0-9])[a-z0-9_\-]*"
            + _SENSITIVE_WORDS
            + r"(?:\\?[\"'])?\s*[:=]\s*(?:\\?[\"'])?)(?!\*\*\*)[^\s\\\"',;&}]+"
        ),
        r"\1" + _MASK,
    ),
    # A password in a URL: scheme://user:password@host.
    (("://",), re.compile(r"(://[^/\s:@]+:)[^@\s/]+@"), r"\1" + _MASK + "@"),
    # Postgres puts values into its diagnostics, whatever the client's hide_parameters:
    # the failing row of a constraint (a job's request with its prompt, a key's prefix),
    # the line a COPY was at (a batch line), a duplicate key's value, rejected input.
    (("failing row contains ",), re.compile(r"(Failing row contains )\([^\n]*"), r"\1(" + _MASK + ")"),
    (("copy ",), re.compile(r"(COPY [^,\n]+, line \d+(?:, column [^:\n]+)?): [^\n]*"), r"\1: " + _MASK),
    (("json data, line ",), re.compile(r"(JSON data, line \d+: )[^\n]*"), r"\1" + _MASK),
    (("key (",), re.compile(r"(Key \([^)\n]*\)=)\([^\n]*"), r"\1(" + _MASK + ")"),
    (('token "',), re.compile(r"(Token )\"[^\n]*\"( is invalid)"), r"\1" + _MASK + r"\2"),
    (("invalid input ",), re.compile(r"(invalid input (?:syntax|value) for [^:\n]+: )[^\n]*"), r"\1" + _MASK),
    # Keys of known shapes, wherever they stand.
    (("llmq-",), re.compile(r"\bllmq-[A-Za-z0-9_\-]{8,}"), "llmq-" + _MASK),
    (("sk-",), re.compile(r"\bsk-[A-Za-z0-9_\-]{8,}"), "sk-" + _MASK),
]
# The four non-ASCII letters that IGNORECASE matches to ASCII ones (re's documentation:
# U+0130 and U+0131 to i, U+017F to s, U+212A to k), as those ASCII letters: with them and
# lower(), a line that could match a pattern holds its gate's text.
_FOLD = str.maketrans({"\u0130": "i", "\u0131": "i", "\u017f": "s", "\u212a": "k"})
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
    folded = (text if text.isascii() else text.translate(_FOLD)).lower()
    for gate, pattern, replacement in _PATTERNS:
        if isinstance(gate, re.Pattern):
            if gate.search(folded) is None:
                continue
        elif not any(map(folded.__contains__, gate)):
            continue
        text = pattern.sub(replacement, text)
    return text


_mask = mask_secrets


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: _MASK if _SENSITIVE_FIELD.search(k) else v
        for k, v in vars(record).items()
        if k not in _STANDARD and not k.startswith(("_", "vllm_")) and k != "data"
    }


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Loggers that say too much at INFO for an operator (their WARNINGs still show).
_NOISY = ("urllib3", "werkzeug", "kombu", "amqp", "httpx", "httpcore", "alembic", "filelock")
# Libraries that configure their own handlers: their records go to the root's instead, so
# every line of a process has one format (vLLM's stdout handler, gunicorn's stderr ones,
# Celery's task logger).
_LIBRARIES = ("vllm", "gunicorn.error", "gunicorn.access", "celery", "celery.task", "celery.redirected")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = " ".join(f"{k}={v}" for k, v in _context(record).items())
        return _mask(f"{base} {extras}" if extras else base)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; `ts` is UTC to the millisecond (`2026-12-01T12:00:00.123Z`)."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": timestamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage().rstrip("\n"),
            **_context(record),
        }
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return _mask(json.dumps(payload, default=str))


def timestamp(created: float) -> str:
    """`created` (seconds since the epoch) as ISO 8601 UTC with milliseconds."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def logging_config(settings: Settings, *, log_file: Path | None = None) -> dict[str, Any]:
    """The whole logging set-up of an llmq process as a `logging.config.dictConfig` document:
    one handler on the root in llmq's format (JSON with `LLMQ_LOG_JSON`) with the request id
    filter, and every library that brings handlers of its own sent to it instead. The
    handler writes to stderr, or to `log_file` with a second one that puts WARNING and
    above on stderr as well (`llmq up`: a person sees problems, the file has everything).

    It is a plain document so that processes llmq does not start itself apply it too: vLLM
    reads it from `VLLM_LOGGING_CONFIG_PATH` in its engine processes (see
    `vllm_logging_environment`)."""
    level = settings.log_level.upper()
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"}
        if settings.log_json
        else {"()": f"{__name__}.KeyValueFormatter", "fmt": TEXT_FORMAT}
    )
    stderr = {
        "class": "logging.StreamHandler",
        "stream": "ext://sys.stderr",
        "formatter": "llmq",
        "filters": ["request_id"],
    }
    handlers: dict[str, Any] = {"llmq": stderr}
    if log_file is not None:
        to_file = {k: v for k, v in stderr.items() if k != "stream"}
        handlers = {
            "llmq": {**to_file, "class": "logging.FileHandler", "filename": str(log_file)},
            "terminal": {**stderr, "level": "WARNING"},
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"llmq": formatter},
        "filters": {"request_id": {"()": RequestIdFilter.__module__ + ".RequestIdFilter"}},
        "handlers": handlers,
        "root": {"level": level, "handlers": list(handlers)},
        "loggers": {
            **{name: {"level": "WARNING"} for name in _NOISY},
            **{name: {"handlers": [], "propagate": True} for name in _LIBRARIES},
        },
    }


def configure_logging(settings: Settings, *, log_file: Path | None = None) -> None:
    """Idempotent: safe to call from every process entry point. `log_file`: see
    `logging_config`."""
    remember_secret(settings.bootstrap_api_key)
    root = logging.getLogger()
    if getattr(root, "_llmq_configured", False):
        return
    logging.config.dictConfig(logging_config(settings, log_file=log_file))
    # Warnings (a library's DeprecationWarning, Celery's SecurityWarning as root) become
    # records of `py.warnings`, in the same format as every other line.
    logging.captureWarnings(True)
    root._llmq_configured = True  # type: ignore[attr-defined]
    unknown = unknown_environment(os.environ)
    if unknown:
        logging.getLogger("llmq.settings").warning(
            "unknown LLMQ_ variables ignored (a typo?): %s", ", ".join(unknown)
        )


def vllm_logging_environment(settings: Settings) -> dict[str, str]:
    """The environment that makes vLLM log in llmq's format in every process it starts (the
    engine core is a process of its own, configured from the environment alone): the
    `logging_config` document written to a file for `VLLM_LOGGING_CONFIG_PATH`. Empty when
    the operator configured vLLM's logging already (either variable set)."""
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ or "VLLM_CONFIGURE_LOGGING" in os.environ:
        return {}
    fd, path = tempfile.mkstemp(prefix="llmq-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(logging_config(settings), f)
    atexit.register(_remove, path)
    return {"VLLM_LOGGING_CONFIG_PATH": path}


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
