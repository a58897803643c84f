"""Connections spread evenly over the API's gunicorn workers.

gunicorn's workers share one listening socket, and whichever process the kernel runs first
takes what is waiting: under a burst, one gevent worker accepted 14 of 16 streams (and all
four keep-alive clients of a submit load) while the other sat idle, so the burst's requests
queued on one core. gunicorn's `--reuse-port` only sets the flag on that one socket, which
changes nothing (benoitc/gunicorn#1984); a socket per worker (the kernel then hashes
connections across them) would drop the connections queued on a worker's socket when that
worker dies, and still put three of four clients on one worker about half the time.

So the workers take turns: each records how many connections it holds in memory the master
shares with them (`Board`, made before the first fork), and a worker holding more than the
least loaded of the others leaves a waiting connection to them (`Gate`), for at most
`DEFER_SECONDS`: a sibling that is stuck or busy costs a new connection that long, never
more. The socket, the backlog and gunicorn's restarts are as before.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import Any

# How long a waiting connection is left to a less loaded worker before this one takes it,
# and how often it looks again meanwhile.
DEFER_SECONDS = 0.005
RETRY_SECONDS = 0.001
_FREE, _RESERVED, _LEAVING = 0, -1, -2


class Board:
    """Per worker slot: the worker's pid (0: free, -1: reserved by the master for a worker
    being forked, -2: its worker has stopped accepting and is finishing its connections)
    and how many connections it holds. Each worker writes only its own slot; the master
    reserves and frees slots. An aligned 8-byte store is atomic on the machines
    llmq runs on, so readers never see a torn value, only a slightly stale one."""

    def __init__(self, slots: int) -> None:
        self._mem = mmap.mmap(-1, 16 * slots)  # anonymous and shared: inherited across fork
        self._cells = memoryview(self._mem).cast("q")
        self.slots = slots

    def reserve(self) -> int | None:
        """A free slot for a worker about to be forked (master), or None when all are taken
        (that worker then accepts as gunicorn does, without taking turns)."""
        for slot in range(self.slots):
            if self._cells[2 * slot] == _FREE:
                self._cells[2 * slot] = _RESERVED
                self._cells[2 * slot + 1] = 0
                return slot
        return None

    def take(self, slot: int, pid: int) -> None:
        """The forked worker claims its reserved slot."""
        self._cells[2 * slot + 1] = 0
        self._cells[2 * slot] = pid

    def leave(self, slot: int) -> None:
        """The worker has stopped accepting (it is shutting down: a restart, a reload,
        `max_requests`): nobody leaves connections to it any more."""
        self._cells[2 * slot] = _LEAVING

    def free(self, slot: int) -> None:
        """The worker has exited (master): its connections are gone with it."""
        self._cells[2 * slot] = _FREE
        self._cells[2 * slot + 1] = 0

    def add(self, slot: int, delta: int) -> None:
        self._cells[2 * slot + 1] += delta

    def held(self, slot: int) -> int:
        return int(self._cells[2 * slot + 1])

    def fewest_elsewhere(self, slot: int) -> int | None:
        """The fewest connections any other running worker holds; None when it runs alone."""
        cells = self._cells
        fewest: int | None = None
        for other in range(self.slots):
            if other != slot and cells[2 * other] > 0:
                held = cells[2 * other + 1]
                if fewest is None or held < fewest:
                    fewest = held
        return fewest


class Gate:
    """One worker's side: count its connections, and say whether a waiting connection is
    better left to another worker now. One wait at a time: the API listens on one address.
    A connection another worker takes between this worker's look at the socket and its
    next turn leaves the wait open, and the next connection is then taken at once: a
    connection's worth of balance, never latency."""

    def __init__(self, board: Board, slot: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._board = board
        self._slot = slot
        self._clock = clock
        self._since: float | None = None  # when this worker began leaving the waiting connection

    def counted(self, handle: Callable[..., Any]) -> Callable[..., Any]:
        """`handle` (serving one connection until it closes), counting it while it runs."""
        board, slot = self._board, self._slot

        def serve(*args: Any) -> Any:
            board.add(slot, 1)
            try:
                return handle(*args)
            finally:
                board.add(slot, -1)

        return serve

    def defers(self) -> bool:
        """True: leave the waiting connection to a less loaded worker for now (asked again
        while it waits, until DEFER_SECONDS have passed since the first time)."""
        fewest = self._board.fewest_elsewhere(self._slot)
        if fewest is None or self._board.held(self._slot) <= fewest:
            self._since = None
            return False
        now = self._clock()
        if self._since is None:
            self._since = now
        elif now - self._since >= DEFER_SECONDS:
            self._since = None
            return False
        return True

    def leave(self) -> None:
        """This worker stops accepting (`Board.leave`)."""
        self._board.leave(self._slot)

    def taken(self) -> None:
        """Nothing waits any more (another worker took the connection): the next one that
        comes gets its own DEFER_SECONDS."""
        self._since = None


def install(gate: Gate) -> None:
    """Make this process's gevent servers ask `gate` before each accept (gunicorn's gevent
    worker accepts one connection per turn of the loop when it has siblings). A deferred
    accept stops watching the socket and looks again after RETRY_SECONDS, so a connection
    left to a sibling costs no busy loop; if by then nothing waits on the socket, another
    worker took it. A server that closes (the worker is shutting down and only finishes its
    connections) takes its worker off the board first."""
    from select import POLLIN

    from gevent.monkey import get_original
    from gevent.server import StreamServer

    accept = StreamServer._do_read
    poll = get_original("select", "poll")  # a look at the socket now, never a wait

    def resume(server: Any) -> None:
        look = poll()
        look.register(server.socket.fileno(), POLLIN)
        if not look.poll(0):
            gate.taken()
        server._start_accepting_if_started()

    def _do_read(self: Any) -> None:
        if gate.defers():
            self.stop_accepting()
            self._timer = self.loop.timer(RETRY_SECONDS)
            self._timer.start(resume, self)
            return
        accept(self)

    close = StreamServer.close

    def _close(self: Any) -> None:
        gate.leave()
        close(self)

    StreamServer._do_read = _do_read
    StreamServer.close = _close
