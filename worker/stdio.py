"""A JSON-logging worker's raw output, made JSON too.

Logging covers what goes through Python's `logging` (llmq's, Celery's and vLLM's records,
in every vLLM process). Some output does not: torch's C++ warnings, tqdm's progress bars
while vLLM loads weights, `print`s in libraries, Celery's shutdown notices. They are
written straight to file descriptors 1 and 2, which the engine processes inherit. With
`LLMQ_LOG_JSON`, the worker points both descriptors at pipes read by a thread of its own:
a line that is already a JSON object (a log record, from this process or an engine
process) passes through as it is; any other line becomes a record of logger `stdout` or
`stderr`, so the worker's log is one JSON object per line, all of it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import threading
import time

from app.logs import JsonFormatter

_STREAMS = (("stdout", 1), ("stderr", 2))
_JOIN_SECONDS = 2.0


def capture_output() -> None:
    """From now on, every line written to fd 1 or 2 (by this process or a child started
    after this) reaches the original fd 2 as a JSON object. Call once, before anything
    writes."""
    sink = os.dup(2)
    lock = threading.Lock()
    readers = []
    for name, fd in _STREAMS:
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        reader = threading.Thread(
            target=_relay, args=(read_end, sink, name, lock), name=f"llmq-{name}", daemon=True
        )
        reader.start()
        readers.append(reader)
    atexit.register(_drain, readers)


def _relay(read_end: int, sink: int, name: str, lock: threading.Lock) -> None:
    formatter = JsonFormatter()
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        pending = b""
        while chunk := pipe.read(65536):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if lines:
                out = b"".join(_as_json(line, name, formatter) for line in lines)
                with lock:
                    _write_all(sink, out)
        if pending:
            with lock:
                _write_all(sink, _as_json(pending, name, formatter))


def _as_json(raw: bytes, name: str, formatter: logging.Formatter) -> bytes:
    # A progress bar redraws its line with `\r`: keep what a terminal would show last.
    text = raw.decode(errors="replace").rsplit("\r", 1)[-1].rstrip()
    if not text:
        return b""
    if text.startswith("{"):
        with contextlib.suppress(ValueError):
            if isinstance(json.loads(text), dict):
                return text.encode() + b"\n"  # a record already (each process formats its own)
    record = logging.makeLogRecord(
        {"name": name, "levelno": logging.INFO, "levelname": "INFO", "msg": text, "args": None}
    )
    record.created = time.time()
    return formatter.format(record).encode() + b"\n"


def _write_all(fd: int, data: bytes) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _drain(readers: list[threading.Thread]) -> None:
    """At exit, let the readers pass on what this process wrote last."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    for _, fd in _STREAMS:
        os.dup2(devnull, fd)  # this process's write ends close; children may hold theirs
    os.close(devnull)
    for reader in readers:
        reader.join(_JOIN_SECONDS)
