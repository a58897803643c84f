"""The API's gunicorn workers take turns at accepting (app/accept_balance.py), under the real
server: keep-alive connections, opened one after another or all at once, end up spread
evenly over its two gevent workers (before, one took 14 of 16 and all of 4); a worker
killed with `kill -9` gives its place on the board to its replacement. Starts no worker and
no engine."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.helpers import ApiProcess, Stores, stack_env

pytestmark = pytest.mark.api_process

ESTABLISHED = psutil.CONN_ESTABLISHED


@pytest.fixture
def api(stores: Stores, logs_dir: Path) -> Iterator[ApiProcess]:
    process = ApiProcess(stack_env(stores, Path("api-only"), "api-only"), logs_dir / "api-accept-balance.log")
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


def both_serving(api: ApiProcess) -> None:
    """Wait until each worker has loaded the app and accepts (the API answers /healthz as
    soon as one does): connections are opened until both hold one, then closed."""
    socks = [served(api)]
    deadline = time.monotonic() + 60
    while min(spread(api, len(socks))) == 0:
        assert time.monotonic() < deadline, f"a worker never accepted: {held(api)}"
        time.sleep(0.2)
        socks.append(served(api))
    close(socks)
    spread(api, 0)


def served(api: ApiProcess) -> socket.socket:
    """A keep-alive connection that has had one request answered (so a worker holds it)."""
    sock = socket.create_connection(("127.0.0.1", api.port), timeout=10)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "connection closed before the answer"
        head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head[:100]
    return sock


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


def test_connections_opened_one_by_one_or_at_once_are_spread_evenly(api: ApiProcess) -> None:
    both_serving(api)
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


def test_a_killed_workers_place_goes_to_its_replacement(api: ApiProcess) -> None:
    socks = [served(api) for _ in range(8)]
    victim = max(workers(api), key=lambda w: held(api).get(w.pid, 0))
    os.kill(victim.pid, signal.SIGKILL)
    close(socks)
    deadline = time.monotonic() + 60
    while len(workers(api)) < 2 or victim.pid in {w.pid for w in workers(api)}:
        assert time.monotonic() < deadline, "gunicorn did not replace the killed worker"
        time.sleep(0.2)
    # Until the replacement has loaded the app, the survivor takes every connection.
    started = time.monotonic()
    served(api).close()
    assert time.monotonic() - started < 2
    # Then, of two connections opened one after the other, the second goes to the worker
    # that holds none. Each try opens a fresh pair: gunicorn closes a keep-alive connection
    # idle for 2 s, and the replacement may take longer than that to load the app.
    deadline = time.monotonic() + 60
    while True:
        first, second = served(api), served(api)
        if spread(api, 2) == [1, 1]:
            break
        close([first, second])
        spread(api, 0)
        assert time.monotonic() < deadline, f"the replacement took no connection: {held(api)}"
        time.sleep(0.2)
    socks = [first, second, *(served(api) for _ in range(14))]
    counts = spread(api, 16)
    assert len(counts) == 2 and counts[1] - counts[0] <= 2, counts
    close(socks)
