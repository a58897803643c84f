"""Taking turns at accepting (app/accept_balance.py): the board the master shares with its
workers, and one worker's gate. (tests/integration/test_accept_balance.py serves connections
through gunicorn itself.)"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import gevent
import gevent.socket
import pytest
from gevent.server import StreamServer

from app.accept_balance import DEFER_SECONDS, RETRY_SECONDS, Board, Gate, install


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def board_with(*held: int) -> Board:
    """A board whose first slots are running workers holding `held` connections each."""
    board = Board(8)
    for count in held:
        slot = board.reserve()
        assert slot is not None
        board.take(slot, 1000 + slot)
        board.add(slot, count)
    return board


def test_slots_are_reserved_taken_and_freed() -> None:
    board = Board(2)
    first, second = board.reserve(), board.reserve()
    assert (first, second) == (0, 1)
    assert board.reserve() is None  # full: that worker accepts without taking turns
    board.take(0, 4242)
    board.add(0, 3)
    assert board.fewest_elsewhere(1) == 3
    # A reserved slot (its worker not started yet) is no one to leave connections to.
    assert board.fewest_elsewhere(0) is None
    board.leave(0)  # shutting down: no longer accepts, finishes its connections
    assert board.fewest_elsewhere(1) is None
    assert board.reserve() is None  # not free until its worker has exited
    board.free(0)
    assert board.fewest_elsewhere(1) is None
    assert board.reserve() == 0


def test_the_board_is_shared_with_forked_workers() -> None:
    board = board_with(0)
    slot = board.reserve()
    assert slot is not None
    pid = os.fork()
    if pid == 0:  # the worker: takes its slot and holds five connections
        board.take(slot, os.getpid())
        board.add(slot, 5)
        os._exit(0)
    os.waitpid(pid, 0)
    assert board.fewest_elsewhere(0) == 5
    assert board.held(slot) == 5


def test_a_worker_holding_no_more_than_the_others_accepts() -> None:
    assert not Gate(board_with(2, 2), 0).defers()
    assert not Gate(board_with(1, 3), 0).defers()
    assert not Gate(board_with(5), 0).defers()  # alone


def test_a_worker_holding_more_leaves_the_connection_to_the_others_for_a_while() -> None:
    clock = Clock()
    board = board_with(3, 1, 2)
    gate = Gate(board, 0, clock)
    assert gate.defers()
    # Looked at again every RETRY_SECONDS while the connection waits: still deferred...
    while clock.now - 100.0 + RETRY_SECONDS < DEFER_SECONDS:
        clock.now += RETRY_SECONDS
        assert gate.defers()
    # ...until DEFER_SECONDS have passed: then this worker takes it (a sibling that does not
    # accept costs a connection that long, no more).
    clock.now += RETRY_SECONDS
    assert not gate.defers()


def test_a_later_connection_gets_a_wait_of_its_own() -> None:
    clock = Clock()
    gate = Gate(board_with(3, 1), 0, clock)
    assert gate.defers()
    clock.now += RETRY_SECONDS
    gate.taken()  # the sibling took that one
    clock.now += DEFER_SECONDS
    # Another comes while this worker still holds more: left to the sibling too, as long.
    assert gate.defers()
    clock.now += DEFER_SECONDS - RETRY_SECONDS
    assert gate.defers()
    clock.now += RETRY_SECONDS
    assert not gate.defers()


def test_the_wait_ends_when_the_others_catch_up() -> None:
    clock = Clock()
    board = board_with(3, 1)
    gate = Gate(board, 0, clock)
    assert gate.defers()
    board.add(1, 2)
    clock.now += RETRY_SECONDS
    assert not gate.defers()


def test_connections_are_counted_while_served_whatever_ends_them() -> None:
    board = board_with(0, 0)
    gate = Gate(board, 0)
    seen = []

    def serve(client: str) -> str:
        seen.append(board.held(0))
        if client == "bad":
            raise ConnectionResetError(client)
        return client

    counted = gate.counted(serve)
    assert counted("ok") == "ok"
    with pytest.raises(ConnectionResetError):
        counted("bad")
    assert seen == [1, 1]
    assert board.held(0) == 0


@pytest.fixture
def gated(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Board, Gate, socket.socket, list[float], StreamServer]]:
    """A gevent server asking a gate before each accept (`install`) whose worker holds one
    connection and its sibling none: the listening socket, and when each connection was
    accepted. The sibling is the test itself, taking connections with `accept()`."""
    monkeypatch.setattr(StreamServer, "_do_read", StreamServer._do_read)  # restored after
    monkeypatch.setattr(StreamServer, "close", StreamServer.close)
    board = board_with(0, 0)
    gate = Gate(board, 0)
    install(gate)
    listener = gevent.socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[float] = []
    server = StreamServer(listener, handle=lambda sock, addr: accepted.append(time.monotonic()))
    server.start()
    # A first connection while the two are even: gevent's first accept takes milliseconds
    # of its own, which must not pass for a wait below.
    warm, _ = connect(listener)
    accepted_count(accepted, 1)
    warm.close()
    accepted.clear()
    board.add(0, 1)
    yield board, gate, listener, accepted, server
    server.stop()


def connect(listener: socket.socket) -> tuple[socket.socket, float]:
    started = time.monotonic()
    return gevent.socket.create_connection(listener.getsockname()), started


def accepted_count(accepted: list[float], count: int) -> None:
    deadline = time.monotonic() + 5
    while len(accepted) < count:
        assert time.monotonic() < deadline, "never accepted"
        gevent.sleep(0.0005)


def test_the_server_leaves_a_connection_to_its_sibling_then_takes_it(gated: Any) -> None:
    board, _, listener, accepted, _ = gated
    client, started = connect(listener)
    accepted_count(accepted, 1)
    assert accepted[0] - started >= DEFER_SECONDS
    board.add(1, 1)  # the sibling caught up: taken at once (no lower bound to assert)
    other, _ = connect(listener)
    accepted_count(accepted, 2)
    client.close()
    other.close()


def test_a_connection_the_sibling_took_ends_the_wait(gated: Any) -> None:
    _, _, listener, accepted, _ = gated
    client, _ = connect(listener)
    gevent.sleep(0)  # the server looks, and leaves it
    listener.settimeout(2)
    taken, _ = listener.accept()  # the sibling takes it
    gevent.sleep(3 * DEFER_SECONDS)
    assert accepted == []
    # The next connection gets a wait of its own, not what remained of the first one's.
    later, started = connect(listener)
    accepted_count(accepted, 1)
    assert accepted[0] - started >= DEFER_SECONDS
    for sock in (client, taken, later):
        sock.close()


def test_a_closing_server_takes_its_worker_off_the_board(gated: Any) -> None:
    """gunicorn closes a worker's server when it shuts down (restart, reload, max_requests)
    and lets it finish its connections: the others stop leaving connections to it."""
    board, _, _, _, server = gated
    board.add(1, 5)  # the sibling now holds more than this worker...
    assert board.fewest_elsewhere(1) == 1
    server.close()
    assert board.fewest_elsewhere(1) is None  # ...and this one no longer counts
