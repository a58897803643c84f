"""A batch's results while it runs: `GET /v1/batches/<id>/results`, every ended line so far
as JSONL (in the output and error files' line shape), or, followed, as server-sent events
until the batch ends.

The order, and why a client never misses a line
------------------------------------------------

Lines are sent in the order they ended, and each has a cursor, `<finished_xid>.<line_no>`:
the id (xid8) of the transaction that made the line terminal (set by a trigger on `jobs`,
migration 20261201_0012, on whatever path ends the line), then its line number. A client
that has every line up to cursor `c` asks for `after=c`; it is promised that it never
misses a line, which holds when every line that becomes readable later has a larger cursor
than any line it was already given: what has been sent is always a prefix of one final
order.

A sequence number taken when the line ends would not do: transaction A takes 7, B takes 8
and commits first; a reader then sees 8 without 7, moves its cursor past 7, and loses A's
line once A commits. Transaction ids have the same gap (they are handed out in one order
and committed in another), but Postgres tells a reader which transactions are still open:
the statement's snapshot lists them (`pg_snapshot_xip`), and every transaction that starts
later gets an id at or above the snapshot's `xmax`. So each read works out a horizon in the
same statement (the same snapshot) as it reads the lines:

    horizon = the smallest id among the snapshot's open transactions, or its xmax if none

and only lines with `finished_xid < horizon` are released. Proof: a line L that is not
visible to the snapshot and commits later belongs to a transaction that was open at the
snapshot (its id is in the list, so >= horizon) or began after it (id >= xmax >= horizon).
Every released line has `finished_xid < horizon`, so L's cursor is larger than all of them.
Lines of one transaction share its id and commit together; `line_no` orders them. (The id
stored is the top-level transaction's, `pg_current_xact_id()`, the kind the snapshot lists;
a savepoint does not change it.)

Open transactions of other databases on the same server cannot write this database's jobs;
an id that `pg_stat_activity` shows as another database's backend is left out of the
horizon (an id it does not show, or shows without privilege to see it, is kept: leaving
an id in only holds lines back). The cost of the scheme is latency, never a lost line: a
long write transaction in this database (a big upload's COPY, say) holds back lines that
ended after it began, until it commits.

When the batch has ended (`completed`, `failed`, `expired`, `cancelled`), the batch row
became terminal only after the finalizer saw every line ended, so no line of it will ever
commit again, and everything visible is released (by the same proof, a line held back
before has a larger cursor than every line released before).

A read first takes this horizon and the last releasable cursor `last` (one short
statement), then sends the lines in `(after, last]` in pages of short keyset queries, each
on its own pooled connection that is returned before any byte goes to the client. Lines
at or below `last` are all committed and never change, so the pages agree with each other.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import select, text, tuple_
from sqlalchemy.exc import SQLAlchemyError

from app.db import Database
from app.domain.status import BatchStatus
from app.errors import InvalidRequest
from app.models import Batch, Job
from app.services.batch_output import DOWNLOAD_PAGE_ROWS, output_line
from app.services.batches import BatchService
from app.services.horizon import HORIZON_CTES
from app.services.keys import Principal
from app.services.ownership import load_owned
from app.services.sse import DONE, HEARTBEAT, frame, named_frame, revoked
from app.services.streaming import KeyWatch

log = logging.getLogger("llmq.results")

ENDED = frozenset({BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})
_CURSOR = re.compile(r"^([0-9]{1,18})\.([0-9]{1,9})$")
_NO_LIMIT = 2**63 - 1

# The batch's status and its last releasable line, read with one snapshot (see above).
_HORIZON = text(
    "WITH"  # noqa: S608 - constants
    + HORIZON_CTES
    + """,
    b AS (SELECT status FROM batches WHERE id = :batch)
    SELECT b.status, last.finished_xid, last.line_no
    FROM b CROSS JOIN horizon LEFT JOIN LATERAL (
      SELECT j.finished_xid, j.line_no FROM jobs j
      WHERE j.batch_id = :batch AND j.finished_xid IS NOT NULL
        AND j.finished_xid < CASE WHEN b.status = ANY(:ended) THEN :no_limit ELSE horizon.h END
      ORDER BY j.finished_xid DESC, j.line_no DESC LIMIT 1
    ) last ON true
    """
)


_LINE_COLUMNS = (Job.finished_xid, Job.line_no, Job.id, Job.custom_id, Job.status, Job.response, Job.error)


@dataclass(frozen=True, order=True)
class Cursor:
    """Where a line sits in the order lines ended: its transaction, then its line."""

    xid: int
    line_no: int

    def __str__(self) -> str:
        return f"{self.xid}.{self.line_no}"


BEFORE_ALL = Cursor(-1, -1)


def parse_cursor(raw: str | None, param: str) -> Cursor | None:
    """A cursor this endpoint sent (`after`, `Last-Event-ID`); None when absent.

    Raises:
        InvalidRequest: not a cursor.
    """
    if raw is None or raw.strip() == "":
        return None
    match = _CURSOR.match(raw.strip())
    if match is None:
        raise InvalidRequest(
            f"`{param}` must be a cursor this endpoint sent, like `1234.7`",
            param=param,
            code="invalid_cursor",
        )
    return Cursor(int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class Horizon:
    """What may be sent now: the batch's status and the last releasable line (None: none)."""

    status: str
    last: Cursor | None

    @property
    def ended(self) -> bool:
        return self.status in ENDED


@dataclass(frozen=True)
class ResultsPrefix:
    """A JSONL answer: the batch's status when it was read, the cursor of its last line
    (or the `after` it was asked with; None: nothing yet), and the lines, generated."""

    status: str
    cursor: Cursor | None
    lines: Iterator[bytes]


class ResultsService:
    def __init__(
        self,
        db: Database,
        batches: BatchService,
        key_watch: KeyWatch,
        *,
        poll_seconds: float = 1.0,
        heartbeat_seconds: float = 15.0,
        key_check_seconds: float = 5.0,
        page: int = DOWNLOAD_PAGE_ROWS,
    ) -> None:
        self._db = db
        self._batches = batches
        self._key_watch = key_watch
        self._poll = poll_seconds
        self._heartbeat = heartbeat_seconds
        self._key_check = key_check_seconds
        self._page = page

    # --- JSONL --------------------------------------------------------------------------

    def prefix(self, principal: Principal, batch_id: str, after: str | None) -> ResultsPrefix:
        """Every line ended so far after `after`. Validates now; the lines are read page by
        page as the body is sent, holding no connection between pages.

        Raises:
            NotFound: no such batch for this tenant.
            InvalidRequest: `after` is not a cursor.
        """
        start = parse_cursor(after, "after")
        self._check_owner(principal, batch_id)
        horizon = self.horizon(batch_id)
        end = horizon.last if horizon.last is not None and (start is None or horizon.last > start) else None
        lines = self._rendered(batch_id, start or BEFORE_ALL, end) if end is not None else iter(())
        return ResultsPrefix(horizon.status, end or start, lines)

    def _rendered(self, batch_id: str, start: Cursor, end: Cursor) -> Iterator[bytes]:
        for _, line in self.lines(batch_id, start, end):
            yield (json.dumps(line, ensure_ascii=False) + "\n").encode("utf-8")

    # --- SSE ----------------------------------------------------------------------------

    def follow(self, principal: Principal, batch_id: str, last_event_id: str | None) -> Iterator[str]:
        """Validate now (404, bad cursor), then return the SSE body: each line as it ends
        (`id:` its cursor), a `batch` event with the ended batch, then `[DONE]`.

        Raises:
            NotFound: no such batch for this tenant.
            InvalidRequest: the cursor is not one this endpoint sent.
        """
        cursor = parse_cursor(last_event_id, "Last-Event-ID")
        self._check_owner(principal, batch_id)
        return self._follow(principal, batch_id, cursor or BEFORE_ALL)

    def _follow(self, principal: Principal, batch_id: str, cursor: Cursor) -> Iterator[str]:
        now = time.monotonic()
        next_heartbeat, next_key_check = now + self._heartbeat, now + self._key_check
        while True:
            if time.monotonic() >= next_key_check:
                # A revoked key's stream stops, even while lines keep coming.
                if not self._key_watch.valid(principal.key_id):
                    yield from revoked()
                    return
                next_key_check = time.monotonic() + self._key_check
            horizon, sent = None, False
            try:
                horizon = self.horizon(batch_id)
                if horizon.last is not None and horizon.last > cursor:
                    for at, line in self.lines(batch_id, cursor, horizon.last):
                        yield frame(line, str(at))
                        cursor, sent = at, True
            except SQLAlchemyError as exc:
                _busy(batch_id, exc)
                horizon = None
            if horizon is not None and horizon.ended:
                try:
                    batch = self._batches.get(principal, batch_id)
                except SQLAlchemyError as exc:
                    _busy(batch_id, exc)
                else:
                    yield named_frame("batch", batch.model_dump(mode="json"))
                    yield DONE
                    return
            if sent:
                next_heartbeat = time.monotonic() + self._heartbeat
            wake_at = min(next_heartbeat, next_key_check, time.monotonic() + self._poll)
            time.sleep(max(0.0, wake_at - time.monotonic()))
            if time.monotonic() >= next_heartbeat:
                yield HEARTBEAT
                next_heartbeat = time.monotonic() + self._heartbeat

    # --- reads --------------------------------------------------------------------------

    def _check_owner(self, principal: Principal, batch_id: str) -> None:
        with self._db.session() as s:
            load_owned(s, Batch, batch_id, principal.tenant_id)

    def horizon(self, batch_id: str) -> Horizon:
        """The batch's status and its last line that may be sent now (module docstring)."""
        params = {"batch": batch_id, "ended": [s.value for s in ENDED], "no_limit": _NO_LIMIT}
        with self._db.engine.connect() as conn:
            row = conn.execute(_HORIZON, params).one()
        last = Cursor(row.finished_xid, row.line_no) if row.finished_xid is not None else None
        return Horizon(row.status, last)

    def lines(self, batch_id: str, start: Cursor, end: Cursor) -> Iterator[tuple[Cursor, dict[str, object]]]:
        """The lines with cursors in (start, end], in order, as output-file lines. Each
        page is its own short query; no connection is held while the caller consumes."""
        key = tuple_(Job.finished_xid, Job.line_no)
        while True:
            q = (
                select(*_LINE_COLUMNS)
                .where(
                    Job.batch_id == batch_id,
                    Job.finished_xid.is_not(None),
                    key > tuple_(start.xid, start.line_no),
                    key <= tuple_(end.xid, end.line_no),
                )
                .order_by(Job.finished_xid, Job.line_no)
                .limit(self._page)
            )
            with self._db.engine.connect() as conn:
                rows = conn.execute(q).all()
            for row in rows:
                start = Cursor(row.finished_xid, row.line_no)
                yield start, output_line(row.id, row.custom_id, row.status, row.response, row.error)
            if len(rows) < self._page:
                return


def _busy(batch_id: str, exc: SQLAlchemyError) -> None:
    # The database is busy or away: a followed stream waits and asks again.
    log.warning("results could not be read", extra={"batch_id": batch_id, "error": type(exc).__name__})
