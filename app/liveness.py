"""Is there a live message for job X? The one place that answers, and what to do when not.

A message only names a job id; the job lives in Postgres. Four facts say whether a
message for a job is live, and this module is the only code that reads or writes them
(besides worker/store.py's lease releases and hand-backs, which clear `enqueued_at`):

- `enqueued_at` (Postgres): when a message was last sent or confirmed; null means one is
  owed (single job: by the sweeper, at once; batch line: by the feeder, when there is room).
- the marker `llmq:sent:<id>` (Redis, TTL the visibility timeout): set after each send,
  dropped when the message is spent (the task ends, however it ends) or found dead.
- a delivery: kombu's `unacked` hash (+ `unacked_index`, by delivery time) holds every
  message a worker took and has not acknowledged; a running job's message is among them.
- the depth of the model's queue (all priority lists): messages waiting to be taken.

The sweeper (worker/sweeper.py) observes them each round and `plan_unclaimed` /
`plan_resends` decide; "old" means past the grace (`requeue_grace_seconds`).

| #  | status         | enqueued_at | marker  | delivery | depth | the sweeper                         |
|----|----------------|-------------|---------|----------|-------|-------------------------------------|
| 1  | queued, single | null        | -       | -        | -     | sends it                            |
| 2  | queued, line   | null        | -       | -        | -     | nothing: the feeder sends it        |
| 3  | queued         | recent      | -       | -        | -     | nothing                             |
| 4  | queued         | old         | gone    | -        | -     | single: sends it; line: hands back  |
| 5  | queued         | old         | present | -        | > 0   | nothing; confirms                   |
| 6  | queued         | old         | present | names it | 0     | nothing; confirms                   |
| 7  | queued         | old         | present | none     | 0     | drops the marker, then as 4         |
| 8  | queued         | -           | -       | old      | -     | drops delivery and marker, then 4   |
| 9  | running        | -           | -       | -        | -     | nothing                             |
| 10 | running        | -           | -       | -        | -     | releases it (lease expired)         |
| 11 | running        | -           | -       | -        | -     | releases it (owner gone)            |
| 12 | ended          | -           | -       | -        | -     | nothing                             |

("-": any; "confirms": `enqueued_at` = now; "hands back": `enqueued_at` = null, row 2.)

1. Released by rows 10-11, re-queued, or handed back by a worker shutting down.
2. Owed by the feeder, which sends lines in chunks while its window has room.
3. Sent within the grace: nothing to check yet.
4. The message is lost: Redis restarted, the send after commit failed, or the message was
   spent without a claim (the task ends, the marker goes, the job is still queued).
5. Waiting behind a backlog.
6. A worker took it and is about to claim it.
7. A worker popped it and died before kombu recorded the delivery: the message is nowhere.
   (One taken this very moment may look the same; the fence makes the copy harmless.)
8. A worker took it and died (or hung) before claiming: the delivery would wait out the
   visibility timeout, hours. Sent again as 4 once `enqueued_at` is old. A delivery of a
   job row 10 just re-queued is dropped too, uncounted.
9. A worker runs it under a live lease; its delivery, however old, is left alone.
10. Its lease expired: back to `queued` with `enqueued_at` null (then 1 or 2), or ended
    `failed` (attempts spent) or `cancelled` (a cancel was asked), with an end event.
11. Its owner's presence lapsed (killed, crashed): as 10, without waiting for the lease.
12. Over: the marker was spent by the task or expires with its TTL.

A job is claimed only while queued (or running under an expired lease), and each claim
bumps its epoch, so a second message for a job (a resend racing a late worker) is
harmless: one claim wins, the other's writes are fenced off. Resending too often costs a
refused claim; resending too rarely leaves a job waiting until its marker expires.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from sqlalchemy import func, select, text, update

from app.db import Database
from app.domain.status import JobStatus
from app.models import Job
from app.queue import PRIORITY_STEPS, RUN_JOB_TASK, RUN_JOBS_TASK, queue_name

SENT_MARKER = "llmq:sent:{job_id}"
# Every marker of a chunk, each with its TTL (ARGV[1] seconds).
_MARK = """
for _, key in ipairs(KEYS) do
  redis.call('SET', key, 1, 'EX', ARGV[1])
end
return #KEYS
"""
# A broker message and its jobs' markers in one step: the push first, so that a push Redis
# refuses (out of memory) leaves no marker saying a message exists. KEYS: the priority list,
# then the markers. ARGV: the message, the markers' TTL.
_PUSH = """
redis.call('LPUSH', KEYS[1], ARGV[1])
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], 1, 'EX', ARGV[2])
end
return #KEYS - 1
"""
# kombu's Redis transport: delivered, unacknowledged messages and their delivery times.
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"

_QUEUED = JobStatus.QUEUED.value

# --- the feeder's view (rows 2 and 10): batch lines with `enqueued_at` null are owed ------

# A batch line the feeder owes a message (the predicate of ix_jobs_undispatched).
_OWED = "status = 'queued' AND batch_id IS NOT NULL AND enqueued_at IS NULL"
# The models with lines owed: a skip scan of ix_jobs_undispatched (one index probe per
# model), not a read of every waiting line, so a round costs the same at 50 lines or
# 5 million.
OWED_MODELS = text(
    f"""
    WITH RECURSIVE m AS (
      (SELECT model FROM jobs WHERE {_OWED} ORDER BY model LIMIT 1)
      UNION ALL
      SELECT (SELECT model FROM jobs WHERE {_OWED} AND model > m.model ORDER BY model LIMIT 1)
      FROM m WHERE m.model IS NOT NULL
    )
    SELECT model FROM m WHERE model IS NOT NULL
    """  # noqa: S608 - constants
)
# Lines out for a model, per tenant: sent (queued with `enqueued_at` set) or running.
OUT_BY_TENANT = text(
    "SELECT tenant_id, count(*) AS n FROM jobs WHERE model = :model AND batch_id IS NOT NULL "
    "AND (status = 'running' OR (status = 'queued' AND enqueued_at IS NOT NULL)) GROUP BY tenant_id"
)
# Lines waiting per tenant, counted up to :cap (the feeder's room: the fair share never
# gives a tenant more), with the tenant's weight: what the fair share divides the room
# among. Tenants by a skip scan, then at most :cap index entries each.
OWED_BY_TENANT = text(
    f"""
    WITH RECURSIVE w AS (
      (SELECT tenant_id FROM jobs WHERE model = :model AND {_OWED} ORDER BY tenant_id LIMIT 1)
      UNION ALL
      SELECT (SELECT tenant_id FROM jobs WHERE model = :model AND {_OWED} AND tenant_id > w.tenant_id
              ORDER BY tenant_id LIMIT 1)
      FROM w WHERE w.tenant_id IS NOT NULL
    )
    SELECT w.tenant_id, c.n, coalesce(t.share_weight, 1.0) AS weight
    FROM w
    CROSS JOIN LATERAL (
      SELECT count(*) AS n FROM (
        SELECT 1 FROM jobs WHERE model = :model AND tenant_id = w.tenant_id AND {_OWED}
        ORDER BY priority, deadline_at, batch_id, prefix_key, line_no LIMIT :cap
      ) AS lines
    ) AS c
    LEFT JOIN tenants t ON t.id = w.tenant_id
    WHERE w.tenant_id IS NOT NULL
    """  # noqa: S608 - constants
)
# Run before OWED_BY_TENANT and TAKE_OWED, in their transaction. Both read lines in the order
# of ix_jobs_undispatched, which holds exactly the owed lines; with sorts ruled out, only that
# index gives it. The planner otherwise took ix_jobs_active (every queued and running job)
# and sorted, whenever its statistics were older than the last burst of lines, as they are
# right after a batch's lines are inserted: it expected 1 owed line where there were 10,000,
# and read every queued one twice a round and once more for each tenant's take (B2's
# 10,000 lines, Postgres time per line: take 52 -> 36 µs, owed count 17 -> 2).
FEEDER_PLANS = text("SET LOCAL enable_sort = off")
# Takes owed lines to send, in priority order, then earliest deadline first, then batch
# order, then lines sharing a prompt prefix together in line order (app/domain/line_order.py):
# their `enqueued_at` is set before the message goes out, so a failed
# send is row 4 of the table.
TAKE_OWED = text(
    """
    UPDATE jobs SET enqueued_at = now()
    WHERE id IN (
      SELECT id FROM jobs
      WHERE model = :model AND tenant_id = :tenant AND status = 'queued' AND batch_id IS NOT NULL
        AND enqueued_at IS NULL
      ORDER BY priority, deadline_at, batch_id, prefix_key, line_no LIMIT :n FOR UPDATE SKIP LOCKED)
    RETURNING id, priority, deadline_at, batch_id, prefix_key, line_no
    """
)


def owed_order(row: Any) -> tuple[Any, ...]:
    """TAKE_OWED's order, for its rows: `RETURNING` keeps no order."""
    return (
        row.priority,
        row.deadline_at is None,
        row.deadline_at,
        row.batch_id,
        row.prefix_key is None,
        row.prefix_key or "",
        row.line_no,
    )


_STALE_QUEUED = text(
    """
    SELECT id, model, priority, batch_id, enqueued_at IS NULL, request_id FROM jobs
    WHERE status = 'queued'
      AND ((batch_id IS NULL AND enqueued_at IS NULL)
           OR enqueued_at < now() - make_interval(secs => :grace))
    ORDER BY enqueued_at NULLS FIRST LIMIT :limit
    """
)


@dataclass(frozen=True)
class Stale:
    """A queued job the sweeper looks at: rows 1 and 4-7 of the table."""

    job_id: str
    model: str
    priority: int
    batch_id: str | None
    never_sent: bool  # `enqueued_at` null (row 1); otherwise old
    request_id: str | None = None  # sent again in the message's headers


# --- decisions: pure functions of what was observed ---------------------------------------


@dataclass(frozen=True)
class Unclaimed:
    """Row 8: deliveries to drop, markers to drop with them, and how many of those jobs
    were not just re-queued for an expired lease (row 10, not counted twice)."""

    tags: list[str]
    forget: set[str]
    count: int


def plan_unclaimed(deliveries: dict[str, list[str]], queued: set[str], requeued: set[str]) -> Unclaimed:
    """`deliveries`: the old ones ({tag: job ids}); `queued`: those of their jobs still
    queued; `requeued`: jobs this round just put back in the queue."""
    tags = [tag for tag, ids in deliveries.items() if queued.intersection(ids)]
    if not tags:
        return Unclaimed([], set(), 0)
    return Unclaimed(tags, set(queued), len(queued - requeued))


@dataclass(frozen=True)
class Observed:
    """What the sweeper saw for the sent (not `never_sent`) stale jobs: those with no
    marker, the models whose queue is empty, every job a delivery names."""

    missing: set[str]
    idle_models: set[str] = field(default_factory=set)
    delivered: set[str] = field(default_factory=set)


@dataclass
class Resends:
    """What one round does for the stale queued jobs."""

    send: list[Stale] = field(default_factory=list)  # rows 1, 4, 7 (single jobs): send again
    hand_back: list[str] = field(default_factory=list)  # rows 4, 7 (batch lines): to the feeder
    confirm: list[str] = field(default_factory=list)  # `enqueued_at` = now: all but handed back
    forget: set[str] = field(default_factory=set)  # row 7: markers of vanished messages

    @property
    def resent(self) -> int:
        return len(self.send) + len(self.hand_back)


def sent_before(stale: Iterable[Stale]) -> list[str]:
    """The stale jobs whose marker must be checked (those sent at some point)."""
    return [job.job_id for job in stale if not job.never_sent]


def vanish_candidates(stale: Iterable[Stale], missing: set[str]) -> list[Stale]:
    """Sent jobs whose marker still says "sent": rows 5-7, told apart by depth and deliveries."""
    return [job for job in stale if not job.never_sent and job.job_id not in missing]


def plan_resends(stale: Sequence[Stale], seen: Observed) -> Resends:
    """The table's rows 1 and 4-7 for the jobs `stale` lists (from `Liveness.stale_queued`)."""
    vanished = {
        job.job_id
        for job in vanish_candidates(stale, seen.missing)
        if job.model in seen.idle_models and job.job_id not in seen.delivered
    }
    dead = seen.missing | vanished
    plan = Resends(forget=vanished)
    for job in stale:
        if job.batch_id is not None and job.job_id in dead:
            plan.hand_back.append(job.job_id)  # the feeder sends it again, in a chunk
        elif job.never_sent or job.job_id in dead:
            plan.send.append(job)
    handed = set(plan.hand_back)
    plan.confirm = [job.job_id for job in stale if job.job_id not in handed]
    return plan


# --- the facts, read and written ----------------------------------------------------------


class Liveness:
    """Markers, deliveries and queue depth in Redis; `enqueued_at` in Postgres (`db` is
    needed only by the sweeper's reads and writes)."""

    def __init__(self, redis: Redis[bytes], *, marker_ttl_seconds: int, db: Database | None = None) -> None:
        self._redis = redis
        self._marker_ttl = marker_ttl_seconds
        self._db = db
        self._mark = redis.register_script(_MARK)
        self._push = redis.register_script(_PUSH)

    # markers

    def sent(self, job_ids: Sequence[str]) -> None:
        """A message naming `job_ids` was just sent."""
        if len(job_ids) == 1:
            self._redis.set(SENT_MARKER.format(job_id=job_ids[0]), 1, ex=self._marker_ttl)
            return
        # One command for a chunk's markers: a pipeline of SETs cost the feeder about 35 µs
        # of Python per line (1.1 ms per 32-line message).
        self._mark(keys=[SENT_MARKER.format(job_id=j) for j in job_ids], args=[self._marker_ttl])

    def push(self, priority_list: str, message: str, job_ids: Sequence[str]) -> None:
        """Put a broker message naming `job_ids` on the queue's `priority_list` (kombu's
        Redis layout, app/queue.py's `TaskMessages`) and mark them sent, in one round trip:
        both happen, or (Redis refused the push) neither. Raises redis errors."""
        keys = [priority_list, *(SENT_MARKER.format(job_id=j) for j in job_ids)]
        self._push(keys=keys, args=[message, self._marker_ttl])

    def spent(self, *job_ids: str) -> None:
        """Drop the markers: the message is spent (its task ended) or found dead. A job
        left queued is then sent again by the sweeper (row 4)."""
        if job_ids:
            self._redis.delete(*(SENT_MARKER.format(job_id=j) for j in job_ids))

    def missing_markers(self, job_ids: Sequence[str]) -> list[str]:
        """The ids among `job_ids` with no live message marker."""
        if not job_ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.exists(SENT_MARKER.format(job_id=job_id))
        return [j for j, exists in zip(job_ids, pipe.execute(), strict=True) if not exists]

    # the broker

    def depth(self, model: str) -> int:
        """Messages waiting in the model's queue, all priorities."""
        name = queue_name(model)
        pipe = self._redis.pipeline(transaction=False)
        for step in PRIORITY_STEPS:
            pipe.llen(name if step == 0 else f"{name}:{step}")
        return sum(pipe.execute())

    def delivered_job_ids(self) -> set[str]:
        """Every job id that an unacknowledged delivery names."""
        return {job_id for ids in self._deliveries("+inf", limit=100_000).values() for job_id in ids}

    def stale_deliveries(self, older_than_seconds: float, limit: int = 1000) -> dict[str, list[str]]:
        """Messages a worker took over `older_than_seconds` ago and has not acknowledged:
        {delivery tag: the job ids they name}. A running job's message is among them."""
        return self._deliveries(time.time() - older_than_seconds, limit=limit)

    def _deliveries(self, before: float | str, *, limit: int) -> dict[str, list[str]]:
        """Unacknowledged deliveries made before `before` (a time, or "+inf" for all)."""
        tags = self._redis.zrangebyscore(UNACKED_INDEX, "-inf", before, start=0, num=limit)
        if not tags:
            return {}
        found = {}
        for tag, raw in zip(tags, self._redis.hmget(UNACKED, tags), strict=True):
            job_ids = _job_ids(raw) if raw is not None else None
            if job_ids is not None:
                found[tag.decode()] = job_ids
        return found

    def drop_deliveries(self, tags: Sequence[str]) -> None:
        """Forget deliveries for good: the broker will not hand them out again."""
        if tags:
            pipe = self._redis.pipeline()
            pipe.zrem(UNACKED_INDEX, *tags)
            pipe.hdel(UNACKED, *tags)
            pipe.execute()

    def unacked_count(self) -> int:
        return int(self._redis.hlen(UNACKED))

    # Postgres: `enqueued_at`

    def stale_queued(self, grace_seconds: float, limit: int = 1000) -> list[Stale]:
        """Single jobs with no message yet (row 1), and queued jobs whose message was last
        confirmed over `grace_seconds` ago (rows 4-7). Batch lines without a message are
        the feeder's (row 2), not listed here."""
        with self._database().session() as s:
            rows = s.execute(_STALE_QUEUED, {"grace": grace_seconds, "limit": limit}).all()
        return [Stale(r[0], r[1], r[2], r[3], bool(r[4]), r[5]) for r in rows]

    def queued_among(self, job_ids: list[str]) -> set[str]:
        if not job_ids:
            return set()
        with self._database().session() as s:
            return set(s.scalars(select(Job.id).where(Job.id.in_(job_ids), Job.status == _QUEUED)))

    def confirmed(self, job_ids: list[str]) -> None:
        """Their messages were sent or found live just now."""
        set_enqueued(self._database(), job_ids, func.now())

    def handed_back(self, job_ids: list[str]) -> None:
        """Batch lines whose message is lost or given back go back to the feeder (row 2)."""
        set_enqueued(self._database(), job_ids, None)

    def _database(self) -> Database:
        if self._db is None:
            raise RuntimeError("this Liveness was built without a database")
        return self._db


def set_enqueued(db: Database, job_ids: list[str], value: Any) -> None:
    """`enqueued_at` of those of `job_ids` still queued (null: the message is owed)."""
    if not job_ids:
        return
    with db.session() as s:
        s.execute(update(Job).where(Job.id.in_(job_ids), Job.status == _QUEUED).values(enqueued_at=value))


def _job_ids(raw: bytes) -> list[str] | None:
    """The job ids an unacknowledged message names; None for anything else."""
    try:
        message = json.loads(raw)[0]
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        task = message["headers"]["task"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if task == RUN_JOB_TASK and args and isinstance(args[0], str):
        return [args[0]]
    if task == RUN_JOBS_TASK and args and isinstance(args[0], list):
        return [str(j) for j in args[0]]
    return None
