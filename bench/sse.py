"""A lean SSE client for B5: one HTTP/1.1 request per connection on asyncio's streams, the
chunked body read as it arrives, each `data:` line stamped with the time its bytes were
read. B5's httpx client took 350-380 ms of CPU per round of 64 streams (5.7 ms a stream) on
the two cores the service streamed them with, and its event loop, busy parsing one stream's
lines, left the others' first chunks waiting in their sockets: time charged to llmq.

The connection is opened before the request is timed (as a client's pool holds one): a
TCP connect is not llmq's time."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Stream:
    """What one stream saw: the status, the response headers (names lower-cased), when the
    request was sent, and each event's (`id`, arrival time) for every `data:` line but
    `[DONE]` (times from `time.time()`, comparable with a worker's event stamps)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    sent: float = 0.0
    arrivals: list[tuple[str, float]] = field(default_factory=list)
    body: bytes = b""  # a refused request's body


class Connection:
    """One open connection, for one streamed POST."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self._reader = reader
        self._writer = writer
        self._host = host

    @classmethod
    async def open(cls, base_url: str) -> Connection:
        url = urlsplit(base_url)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer, f"{host}:{port}")

    async def post_stream(self, path: str, body: Any, headers: dict[str, str]) -> Stream:
        """POST `body` as JSON and read the answer to its end; then close."""
        payload = json.dumps(body).encode()
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {self._host}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(payload)}",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        out = Stream(sent=time.time())
        try:
            self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
            await self._read_head(out)
            if out.status != 200:
                out.body = await self._read_body(out)
                return out
            await self._read_events(out)
            return out
        finally:
            self._writer.close()

    async def _read_head(self, out: Stream) -> None:
        status = await self._reader.readline()
        parts = status.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
            raise ConnectionError(f"not an HTTP response: {status[:100]!r}")
        out.status = int(parts[1])
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            out.headers[name.strip().lower()] = value.strip()

    async def _chunks(self, out: Stream) -> Any:
        """The body's pieces as they arrive, each with its arrival time."""
        if out.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self._reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while await self._reader.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return
                data = await self._reader.readexactly(size + 2)  # the chunk and its CRLF
                yield data[:-2], time.time()
        elif "content-length" in out.headers:
            yield await self._reader.readexactly(int(out.headers["content-length"])), time.time()
        else:
            while data := await self._reader.read(65536):
                yield data, time.time()

    async def _read_body(self, out: Stream) -> bytes:
        return b"".join([data async for data, _ in self._chunks(out)])

    async def _read_events(self, out: Stream) -> None:
        pending = b""
        event_id: str | None = None
        async for data, arrived in self._chunks(out):
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"id:"):
                    event_id = line[3:].strip().decode()
                elif line.startswith(b"data:") and event_id and line[5:].strip() != b"[DONE]":
                    out.arrivals.append((event_id, arrived))
