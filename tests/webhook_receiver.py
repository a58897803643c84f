"""A real HTTP server that receives webhooks, for the api and fault tiers: it records each
request's headers and raw body, answers with a chosen status, and can be stopped and
started again on the same port (a receiver that is down for a while)."""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app.cli.embedded import free_port


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes


class Receiver:
    def __init__(self, status: int = 200) -> None:
        self.port = free_port(19500 + secrets.randbelow(400))
        self.url = f"http://127.0.0.1:{self.port}/hooks"
        self.status = status
        self.received: list[Received] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with receiver._lock:
                    receiver.received.append(Received({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def event_ids(self) -> set[str]:
        with self._lock:
            return {r.headers["webhook-id"] for r in self.received}

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.received)
