"""A closed-loop HTTP load generator light enough to share a 2-core machine with the
service: `clients` threads, each on one keep-alive connection (http.client), sending the
same request back to back for `seconds`. Latencies are recorded per request."""

from __future__ import annotations

import gc
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


@dataclass
class Load:
    """What one run saw: latencies in seconds, errors (non-2xx or broken connections)."""

    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def p(self, q: float) -> float:
        return pct(self.latencies, q)

    def summary(self) -> dict[str, float]:
        return {
            "rps": round(self.rate, 1),
            "p50_ms": round(self.p(50) * 1e3, 2),
            "p99_ms": round(self.p(99) * 1e3, 2),
            "errors": self.errors,
        }


def request_fn(
    base_url: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> Callable[[], Callable[[], int]]:
    """A factory of per-thread senders: each opens its own connection and returns the status."""
    url = urlsplit(base_url)
    payload = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}

    def make() -> Callable[[], int]:
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=30)

        def send() -> int:
            conn.request(method, path, body=payload, headers=hdrs)
            r = conn.getresponse()
            r.read()
            return r.status

        return send

    return make


def run(make: Callable[[], Callable[[], int]], clients: int, seconds: float, warmup: float = 0.5) -> Load:
    """`clients` closed loops for `warmup` + `seconds`; only the last `seconds` are counted."""
    load = Load(seconds=seconds)
    lock = threading.Lock()
    start = time.perf_counter() + warmup
    stop = start + seconds

    def loop() -> None:
        send = make()
        mine: list[float] = []
        errors = 0
        while True:
            t0 = time.perf_counter()
            if t0 >= stop:
                break
            try:
                ok = 200 <= send() < 300
            except (OSError, http.client.HTTPException):
                ok = False
                send = make()
            t1 = time.perf_counter()
            if t0 >= start:
                if ok:
                    mine.append(t1 - t0)
                else:
                    errors += 1
        with lock:
            load.latencies.extend(mine)
            load.errors += errors

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return load


def burst(base_url: str, path: str, bodies: list[Any], headers: dict[str, str], clients: int) -> list[Any]:
    """POST each body to `path`, `clients` at once, and return the JSON answers in body order.
    Each client is a thread on a keep-alive connection opened before the first request
    (http.client, bodies encoded beforehand). B1's 64 submits through one shared httpx client
    from a pool of threads started as they were needed cost this process 100 ms of CPU (1.6
    ms a submit) on the cores the service was admitting them with.

    Raises:
        RuntimeError: a request answered with a non-2xx status (its body is in the message).
    """
    url = urlsplit(base_url)
    payloads = [json.dumps(body).encode() for body in bodies]
    hdrs = {"Content-Type": "application/json", **headers}
    answers: list[Any] = [None] * len(bodies)
    failures: list[str] = []
    turns = iter(range(len(bodies)))  # next() on a range iterator is atomic under the GIL
    clients = max(1, min(clients, len(bodies)))
    ready = threading.Barrier(clients)

    def client() -> None:
        conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port or 80, timeout=120)
        try:
            conn.connect()
            ready.wait()
            for i in turns:
                conn.request("POST", path, body=payloads[i], headers=hdrs)
                r = conn.getresponse()
                raw = r.read()
                if not 200 <= r.status < 300:
                    failures.append(f"{r.status}: {raw[:300]!r}")
                    return
                answers[i] = json.loads(raw)
        except (OSError, http.client.HTTPException, threading.BrokenBarrierError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            ready.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(f"{len(failures)} of the burst's requests failed; the first: {failures[0]}")
    return answers


def rounds(n: int, samples: int) -> int:
    """How many rounds of `n` concurrent requests give at least `samples` requests (three at
    least): a p99 read from one round of one request is that request."""
    return max(3, -(-samples // n))


@contextmanager
def no_collections() -> Iterator[None]:
    """A timed round with none of the timing process's own garbage collections in it: one
    before, none during. B5's client made a new httpx client each round, and the one
    before it went as garbage (its SSL context, pools and sockets) in a collection of 7-22
    ms at any point of a later round: about one first chunk in ten at one stream was late
    by that much, charged to llmq. For the load generator only: the direct baseline's
    caller is AsyncLLM's own process, whose collections are part of what it measures (as
    the API's and the worker's are on llmq's side)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
