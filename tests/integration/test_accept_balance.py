"""The API's gunicorn workers take turns at accepting (app/accept_balance.py), under the real
server: keep-alive connections, opened one after another or all at once, end up spread
evenly over its two gevent workers (before, one took 14 of 16 and all of 4); a worker
killed with `kill -9` gives its place on the board to its replacement. Starts no worker and
no engine."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from tests.helpers import ApiProcess, Stores, stack_env

pytestmark = pytest.mark.api_process

ESTABLISHED = psutil.CONN_ESTABLISHED


POOL = 3  # each API worker's Postgres connections, opened as it starts


@pytest.fixture
def api(stores: Stores, logs_dir: Path) -> Iterator[ApiProcess]:
    env = stack_env(stores, Path("api-only"), "api-only", LLMQ_DB_POOL_SIZE=str(POOL))
    process = ApiProcess(env, logs_dir / "api-accept-balance.log")
    yield process
    process.stop()


def workers(api: ApiProcess) -> list[psutil.Process]:
    return psutil.Process(api.proc.pid).children()


def held(api: ApiProcess) -> dict[int, int]:
    """Each worker's established connections on the API's port."""
    port = api.port
    return {
        w.pid: sum(1 for c in w.net_connections("tcp") if c.laddr.port == port and c.status == ESTABLISHED)
        for w in workers(api)
    }


def both_serving(api: ApiProcess, stores: Stores) -> None:
    """Wait until each worker has loaded the app and accepts (the API answers /healthz as
    soon as one does): connections are opened until both hold one, then closed. And until
    each has started (`pool_opened`)."""
    socks = [served(api)]
    deadline = time.monotonic() + 60
    while min(spread(api, len(socks))) == 0:
        assert time.monotonic() < deadline, f"a worker never accepted: {held(api)}"
        time.sleep(0.2)
        socks.append(served(api))
    close(socks)
    spread(api, 0)
    for worker in workers(api):
        pool_opened(worker, stores)


def pool_opened(worker: psutil.Process, stores: Stores) -> None:
    """Wait until `worker` has opened its pool of Postgres connections, the last of its
    start: until then it has busy moments in which its sibling, after its short wait, takes
    what comes."""
    port = urlsplit(stores.database_url).port
    deadline = time.monotonic() + 30
    while True:
        connections = worker.net_connections("tcp")
        opened = sum(1 for c in connections if c.raddr and c.raddr.port == port and c.status == ESTABLISHED)
        if opened >= POOL:
            return
        assert time.monotonic() < deadline, f"worker {worker.pid} did not open its pool"
        time.sleep(0.1)


def served(api: ApiProcess) -> socket.socket:
    """A keep-alive connection that has had one request answered (so a worker holds it)."""
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=10)
    answered(sock)
    return sock


def answered(sock: socket.socket) -> None:
    """One /healthz asked and its whole answer read, the connection kept."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before the answer"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before the answer"
        body += chunk


class Kept:
    """Connections kept open: each asks again every half second, so that gunicorn never
    closes it as idle (its keep-alive limit is 2 s). Closed when the block ends."""

    def __init__(self) -> None:
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def __enter__(self) -> Kept:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        close(self._socks)

    def add(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)

    def _refresh(self) -> None:
        while not self._done.wait(0.5):
            with self._lock:
                for sock in self._socks:
                    answered(sock)


def spread(api: ApiProcess, expected: int) -> list[int]:
    """The connections each worker holds, once the API's workers hold all `expected`."""
    deadline = time.monotonic() + 10
    while True:
        counts = sorted(held(api).values())
        if sum(counts) == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.1)


def close(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_connections_opened_one_by_one_or_at_once_are_spread_evenly(api: ApiProcess, stores: Stores) -> None:
    both_serving(api, stores)
    one_by_one = [served(api) for _ in range(16)]
    counts = spread(api, 16)
    assert len(counts) == 2 and counts[1] - counts[0] <= 2, counts
    close(one_by_one)
    spread(api, 0)

    with ThreadPoolExecutor(32) as pool:
        at_once = list(pool.map(lambda _: served(api), range(32)))
    counts = spread(api, 32)
    assert len(counts) == 2 and counts[1] - counts[0] <= 4, counts
    close(at_once)


def test_a_killed_workers_place_goes_to_its_replacement(api: ApiProcess, stores: Stores) -> None:
    """The survivor holds six connections when the replacement starts: with the replacement
    on the board, the survivor leaves each new connection to it until both hold six. Off the
    board, the survivor would take new connections as often as it wins the race for them
    (about half; on some machines most), and the replacement would end with three or four."""
    both_serving(api, stores)
    socks = [served(api) for _ in range(8)]
    victim, survivor = sorted(workers(api), key=lambda w: held(api).get(w.pid, 0), reverse=True)
    os.kill(victim.pid, signal.SIGKILL)
    close(socks)
    deadline = time.monotonic() + 60
    while len(workers(api)) < 2 or victim.pid in {w.pid for w in workers(api)}:
        assert time.monotonic() < deadline, "gunicorn did not replace the killed worker"
        time.sleep(0.2)
    # Until the replacement has loaded the app, the survivor takes every connection; these
    # six are kept open (gunicorn closes a keep-alive connection idle for 2 s).
    with Kept() as kept:
        started = time.monotonic()
        for _ in range(6):
            kept.add(served(api))
        assert time.monotonic() - started < 2
        assert held(api).get(survivor.pid) == 6, held(api)
        # The replacement's first connection: until it accepts, a connection goes to the
        # survivor (it then holds seven) and is closed again.
        deadline = time.monotonic() + 60
        while True:
            sock = served(api)
            if held(api).get(survivor.pid) == 6:
                kept.add(sock)
                break
            sock.close()
            assert time.monotonic() < deadline, f"the replacement took no connection: {held(api)}"
            time.sleep(0.2)
        (replacement,) = (w for w in workers(api) if w.pid != survivor.pid)
        pool_opened(replacement, stores)
        for _ in range(5):
            kept.add(served(api))
        counts = held(api)
        assert counts[replacement.pid] >= 5 and counts[survivor.pid] <= 7, counts
