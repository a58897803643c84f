"""A batch's line counts and token sums for `GET /v1/batches/<id>`, without aggregating
every line on every poll: a client polling a 50,000-line batch every second made each poll
an aggregate over all its rows (36 ms of Postgres at 10,000 lines), growing with the batch.

Each API process keeps, per batch it was asked about, what is settled: the counts and sums
of the lines that ended in transactions below a horizon `h`, read in the same statement:
the oldest transaction of this database still open then, or the snapshot's xmax if none
(the results stream's horizon, app/services/results.py, which also argues it). Every
transaction that commits later has an id at or above `h` (it was open then, or started
since), and a line that ended never changes again, so that part is final. A poll then
reads only the lines that ended at or above the kept horizon (the index on (batch_id,
finished_xid)) and the running lines (ix_jobs_batch_running; the feeder's window bounds
them), and moves the horizon on. Queued lines are the rest: a batch's rows are all inserted
when it leaves `validating` and never deleted while it can be read. A horizon that goes
back, or counts that stop adding up, drop what was kept.

The first read of a batch in a process is the full aggregate, as before."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.domain.status import JobStatus
from app.services.batch_transitions import LINE_SUMS
from app.services.horizon import HORIZON_CTES

log = logging.getLogger("llmq.batches")

ENDED = (
    JobStatus.SUCCEEDED.value,
    JobStatus.FAILED.value,
    JobStatus.CANCELLED.value,
    JobStatus.EXPIRED.value,
)

# Every line, by status; `settled`: ended below the horizon (or before lines had an xid).
_ALL = text(
    "WITH"  # noqa: S608 - constants
    + HORIZON_CTES
    + """
    SELECT horizon.h AS horizon, j.status,
           (j.finished_xid IS NULL OR j.finished_xid < horizon.h) AS settled,
    """
    + LINE_SUMS
    + """
    FROM jobs j CROSS JOIN horizon WHERE j.batch_id = :batch
    GROUP BY horizon.h, j.status, settled
    """
)

# The lines that ended at or above `since`, and the running ones (ix_jobs_batch_running);
# one statement, so one snapshot: what it counts adds up.
_SINCE = text(
    "WITH"  # noqa: S608 - constants
    + HORIZON_CTES
    + """
    SELECT horizon.h AS horizon, x.status, x.settled, x.n, x.prompt, x.completion, x.cached,
           (SELECT count(*) FROM jobs r
            WHERE r.batch_id = :batch AND r.status = 'running') AS running
    FROM horizon LEFT JOIN LATERAL (
      SELECT j.status, j.finished_xid < horizon.h AS settled,
    """
    + LINE_SUMS
    + """
      FROM jobs j WHERE j.batch_id = :batch AND j.finished_xid >= :since
        AND j.status IN ('succeeded', 'failed', 'cancelled', 'expired')
      GROUP BY j.status, settled
    ) x ON true
    """
)


class Count(NamedTuple):
    """Lines of one status and their token sums (what app/services/batches.py reads)."""

    status: str
    n: int
    prompt: int
    completion: int
    cached: int


@dataclass(frozen=True)
class _Settled:
    horizon: int
    rows: int  # every line of the batch
    ended: dict[str, Count]  # by status, lines that ended below the horizon


def _add(into: dict[str, Count], row: Any) -> None:
    had = into.get(row.status)
    into[row.status] = Count(
        row.status,
        int(row.n) + (had.n if had else 0),
        int(row.prompt) + (had.prompt if had else 0),
        int(row.completion) + (had.completion if had else 0),
        int(row.cached) + (had.cached if had else 0),
    )


class BatchCounts:
    """Per process; `size` batches at most, the least recently read forgotten first."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._settled: OrderedDict[str, _Settled] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, s: Session, batch_id: str) -> list[Count]:
        """The batch's lines by status, with token sums, as one snapshot sees them."""
        with self._lock:
            known = self._settled.get(batch_id)
            if known is not None:
                self._settled.move_to_end(batch_id)
        if known is None:
            return self._first(s, batch_id)
        rows = s.execute(_SINCE, {"batch": batch_id, "since": known.horizon}).all()
        ended = dict(known.ended)
        settled = dict(known.ended)
        for row in rows:
            if row.status is None:  # no line ended since: the lateral join's empty row
                continue
            _add(ended, row)
            if row.settled:
                _add(settled, row)
        horizon, running = int(rows[0].horizon), int(rows[0].running)
        queued = known.rows - sum(c.n for c in ended.values()) - running
        if horizon < known.horizon or queued < 0:
            # Not what this scheme allows (a failover to a standby that lost transactions,
            # say): what was kept cannot be trusted; count everything again.
            log.warning(
                "batch counts kept no longer add up; counted again",
                extra={"batch_id": batch_id, "horizon": horizon, "kept_horizon": known.horizon},
            )
            with self._lock:
                self._settled.pop(batch_id, None)
            return self._first(s, batch_id)
        self._keep(batch_id, _Settled(horizon, known.rows, settled))
        live = [
            Count(JobStatus.QUEUED.value, queued, 0, 0, 0),
            Count(JobStatus.RUNNING.value, running, 0, 0, 0),
        ]
        return [c for c in live if c.n] + list(ended.values())

    def _first(self, s: Session, batch_id: str) -> list[Count]:
        rows = s.execute(_ALL, {"batch": batch_id}).all()
        counts: dict[str, Count] = {}
        settled: dict[str, Count] = {}
        for row in rows:
            _add(counts, row)
            if row.settled and row.status in ENDED:
                _add(settled, row)
        if rows:  # a batch still `validating` has no rows yet: nothing to keep
            total = sum(c.n for c in counts.values())
            self._keep(batch_id, _Settled(int(rows[0].horizon), total, settled))
        return list(counts.values())

    def _keep(self, batch_id: str, settled: _Settled) -> None:
        with self._lock:
            self._settled[batch_id] = settled
            self._settled.move_to_end(batch_id)
            while len(self._settled) > self._size:
                self._settled.popitem(last=False)
