"""Job state transitions the worker makes, each one guarded.

The claim bumps `epoch`; every later write says `WHERE epoch = :mine AND status =
'running'`, so a worker that lost its lease (paused, partitioned, too slow) cannot
overwrite the result of the worker that took over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import select, text

from app.db import Database
from app.domain.status import JobStatus
from app.jsontext import compact
from app.liveness import set_enqueued
from app.models import Job
from app.services.webhook_outbox import FINISH_EVENTS, new_event_id, record_jobs

_RUNNING = JobStatus.RUNNING.value


@dataclass(frozen=True)
class Claim:
    job_id: str
    epoch: int
    attempts: int
    kind: str
    model: str
    priority: int
    tenant_id: str
    request: dict[str, Any]
    created_at: datetime
    batch_id: str | None
    # Size of the stored request (bytes of JSON text); over the claim's bound, `request` is {}.
    request_bytes: int = 0
    # The X-Request-ID of the request that created the job: in each of its log lines.
    request_id: str | None = None
    # Seconds from the job's creation to its first claim (the queue wait, the same on every
    # attempt), and to this claim (its age when this attempt began).
    queue_wait_seconds: float = 0.0
    age_seconds: float = 0.0


@dataclass(frozen=True)
class Expired:
    job_id: str
    status: str
    model: str
    priority: int
    batch_id: str | None
    epoch: int = 0
    error: dict[str, Any] | None = None


@dataclass
class Result:
    """What one attempt ends with: written only if the job is still running under `epoch`.
    Status `queued` hands the job back (shutdown, dead engine)."""

    job_id: str
    epoch: int
    status: str
    response: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    generation_stats: dict[str, Any] | None = None
    power_usage: dict[str, Any] | None = None
    events: list[dict[str, Any]] | None = None
    end: dict[str, Any] | None = field(default=None, repr=False)
    completion_tokens: int = 0
    # The job's timings (seconds, see Job): stored with an end, never with a hand-back.
    queue_wait_seconds: float | None = None
    ttft_seconds: float | None = None
    e2e_seconds: float | None = None


# The rows are found by their ids alone (the primary key). The status test is a CASE, which
# implies no partial index's predicate: written `status = 'queued' OR ...`, it let the planner
# walk ix_jobs_active (every queued and running job) instead, whenever its statistics were
# older than the queue's last burst, as they are right after a batch's lines are inserted
# (the table's last ANALYZE saw none of them queued): B2's 10,000 lines, 32 ids a claim,
# 12,000 index entries read for each: 147 µs of Postgres time per line, 40 by the key.
_CLAIM_SQL = """
    UPDATE jobs SET
      status = 'running', epoch = epoch + 1, attempts = attempts + 1,
      lease_owner = :owner, lease_expires_at = now() + make_interval(secs => :lease),
      started_at = coalesce(started_at, now())
    WHERE {ids} AND attempts < :max_attempts AND cancel_requested_at IS NULL
      AND CASE status WHEN 'queued' THEN true WHEN 'running' THEN lease_expires_at < now() ELSE false END
    RETURNING id, epoch, attempts, kind, model, priority, tenant_id,
      CASE WHEN octet_length(request::text) > :max_request THEN CAST('{}' AS json) ELSE request END,
      created_at, batch_id, octet_length(request::text), request_id,
      greatest(0, extract(epoch FROM started_at - created_at))::float8,
      greatest(0, extract(epoch FROM now() - created_at))::float8
    """
_CLAIM = text(_CLAIM_SQL.replace("{ids}", "id = ANY(:ids)"))
# One id (a single job's claim, nearly every claim outside a batch): `id = :id`, whose
# generic plan (the key, one row) psycopg's prepared statement keeps after five runs. With
# an array the planner's generic guess is many rows, and it planned every claim again: 166
# of a claim's 320 µs of Postgres time under B3's load, 3 µs once prepared.
_CLAIM_ONE = text(_CLAIM_SQL.replace("{ids}", "id = :id"))

# One statement for a whole chunk; each row is written only under the epoch its claim got.
# The rows travel as one JSON array of objects whose documents are JSON strings:
# json_to_recordset parses each row once into typed columns, a document's column being the
# string's own text, cast to json as is, so U+0000 (which a model can produce and `jsonb`
# refuses) survives; one serialization in C (app/jsontext.py) beats psycopg escaping text arrays. (Read with
# `r->>n` from json_array_elements instead, every mention of a field parsed the whole row
# again, `status` alone 17 times: 0.27 ms of Postgres CPU per line of B2, a quarter of all.)
# A single job that ends gets its webhook events in the same statement: an event id is
# made for every row (microseconds), used only by single jobs whose tenant has an endpoint.
# The ids also travel as an array: `j.id = ANY(:ids)` has the primary key find the rows.
# Joined on the JSON alone, the planner guessed 100 rows for it and walked the `status =
# 'running'` index instead, through every dead entry a busy queue leaves there: 30 ms a
# call at 10,000 lines, growing with the table. Its status test is a CASE, as the claim's:
# `j.status = 'running'` implies ix_jobs_active's predicate, and with statistics older than
# the running jobs (an ANALYZE that saw none) the planner walked that index, every running
# job, for a few ids, even with the array.
_FINISH_UPDATE = """
    WITH done AS (
    UPDATE jobs AS j SET
      status = v.status,
      response = CASE WHEN v.status = 'queued' THEN j.response ELSE CAST(v.response AS json) END,
      error = CASE WHEN v.status = 'queued' THEN j.error ELSE CAST(v.error AS json) END,
      usage = CASE WHEN v.status = 'queued' THEN j.usage ELSE CAST(v.usage AS jsonb) END,
      generation_stats = CASE WHEN v.status = 'queued' THEN j.generation_stats
                              ELSE CAST(v.stats AS jsonb) END,
      power_usage = CASE WHEN v.status = 'queued' THEN j.power_usage ELSE CAST(v.power AS jsonb) END,
      events = CASE WHEN v.status = 'queued' THEN j.events ELSE CAST(v.events AS json) END,
      queue_wait_seconds = CASE WHEN v.status = 'queued' THEN j.queue_wait_seconds ELSE v.queue_wait END,
      ttft_seconds = CASE WHEN v.status = 'queued' THEN j.ttft_seconds ELSE v.ttft END,
      e2e_seconds = CASE WHEN v.status = 'queued' THEN j.e2e_seconds ELSE v.e2e END,
      succeeded_at = CASE WHEN v.status = 'succeeded' THEN now() ELSE j.succeeded_at END,
      failed_at = CASE WHEN v.status = 'failed' THEN now() ELSE j.failed_at END,
      cancelled_at = CASE WHEN v.status = 'cancelled' THEN now() ELSE j.cancelled_at END,
      enqueued_at = CASE WHEN v.status = 'queued' THEN NULL ELSE j.enqueued_at END,
      finished_by = CASE WHEN v.status = 'queued' THEN NULL ELSE j.lease_owner END,
      lease_owner = NULL,
      lease_expires_at = NULL
    FROM json_to_recordset(CAST(:rows AS json)) AS v(
      id text, epoch bigint, status text, response text, error text, usage text, stats text,
      power text, events text, event_id text, queue_wait float8, ttft float8, e2e float8)
    WHERE j.id = ANY(:ids) AND j.id = v.id AND j.epoch = v.epoch
      AND CASE j.status WHEN 'running' THEN true ELSE false END
    RETURNING j.id, j.tenant_id, j.status, j.batch_id, v.event_id
    ),
"""
_FINISH = text(_FINISH_UPDATE + FINISH_EVENTS + "SELECT id FROM done")  # noqa: S608 - constants


_EXTEND = text(
    """
    WITH free AS (
      SELECT id FROM jobs WHERE lease_owner = :owner AND status = 'running' FOR UPDATE SKIP LOCKED)
    UPDATE jobs SET lease_expires_at = now() + make_interval(secs => :lease)
    FROM free WHERE jobs.id = free.id
    """
)
_OWNED = text(
    "SELECT id, epoch, cancel_requested_at IS NOT NULL AS cancelled FROM jobs "
    "WHERE lease_owner = :owner AND status = 'running'"
)


def _doc(value: Any) -> str | None:
    return None if value is None else compact(value)


class JobStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def claim_many(
        self,
        job_ids: list[str],
        owner: str,
        lease_seconds: float,
        max_attempts: int,
        *,
        max_request_bytes: int = 2**62,
    ) -> list[Claim]:
        """Take every job among `job_ids` that is queued, or running under an expired
        lease, and has attempts left; the others belong to someone else or are over.
        A request over `max_request_bytes` is not read (its claim has `request` {} and its
        size), so a huge one costs the worker no memory."""
        one = len(job_ids) == 1
        params = {
            **({"id": job_ids[0]} if one else {"ids": job_ids}),
            "owner": owner,
            "lease": lease_seconds,
            "max_attempts": max_attempts,
            "max_request": max_request_bytes,
        }
        by_id = {row[0]: Claim(*row) for row in self._db.returning(_CLAIM_ONE if one else _CLAIM, params)}
        return [by_id[j] for j in job_ids if j in by_id]

    def claim(self, job_id: str, owner: str, lease_seconds: float, max_attempts: int) -> Claim | None:
        claims = self.claim_many([job_id], owner, lease_seconds, max_attempts)
        return claims[0] if claims else None

    def finish_many(self, results: list[Result]) -> set[str]:
        """Write every result still owed (the fence refuses the rest); the ids written."""
        if not results:
            return set()
        rows = [
            {
                "id": r.job_id,
                "epoch": r.epoch,
                "status": r.status,
                "response": _doc(r.response),
                "error": _doc(r.error),
                "usage": _doc(r.usage),
                "stats": _doc(r.generation_stats),
                "power": _doc(r.power_usage),
                "events": _doc(r.events),
                "event_id": new_event_id(),
                "queue_wait": r.queue_wait_seconds,
                "ttft": r.ttft_seconds,
                "e2e": r.e2e_seconds,
            }
            for r in results
        ]
        params = {"rows": compact(rows), "ids": [r.job_id for r in results]}
        return {row[0] for row in self._db.returning(_FINISH, params)}

    def extend_leases(self, owner: str, lease_seconds: float) -> dict[str, tuple[int, bool]]:
        """Extend every lease `owner` holds; returns {job_id: (epoch, cancel_requested)}.
        A row another statement is writing at this moment (its result being saved, a
        cancel) is skipped, its lease extended on the next round: waiting for it while
        holding the others could deadlock with that statement. It is still reported, as
        last committed."""
        params = {"owner": owner, "lease": lease_seconds}
        with self._db.session() as s:
            s.execute(_EXTEND, params)
            return {r.id: (r.epoch, r.cancelled) for r in s.execute(_OWNED, params)}

    def status(self, job_id: str) -> str | None:
        with self._db.session() as s:
            return s.scalar(select(Job.status).where(Job.id == job_id))

    # --- sweeper ---------------------------------------------------------------------

    def expire_leases(self, max_attempts: int) -> list[Expired]:
        """Running jobs whose owner stopped renewing: back to the queue, or failed when
        attempts are spent, or cancelled when a cancel was asked for."""
        return self._release(
            "SELECT id FROM jobs WHERE status = 'running' AND lease_expires_at < now() "
            "ORDER BY lease_expires_at LIMIT 1000 FOR UPDATE SKIP LOCKED",
            {"max_attempts": max_attempts},
        )

    def running_owners(self) -> list[str]:
        """The workers holding running jobs."""
        with self._db.session() as s:
            return list(
                s.scalars(
                    select(Job.lease_owner)
                    .where(Job.status == _RUNNING, Job.lease_owner.is_not(None))
                    .distinct()
                )
            )

    def release_owned_by(self, owners: list[str], max_attempts: int) -> list[Expired]:
        """Running jobs of workers known to be gone, as their leases ending would (the new
        claim's epoch fences off the old owner, should it be alive after all)."""
        if not owners:
            return []
        return self._release(
            "SELECT id FROM jobs WHERE status = 'running' AND lease_owner = ANY(:owners) "
            "LIMIT 1000 FOR UPDATE SKIP LOCKED",
            {"max_attempts": max_attempts, "owners": owners},
        )

    def _release(self, which: str, params: dict[str, Any]) -> list[Expired]:
        sql = text(
            f"""
            UPDATE jobs SET
              status = CASE
                WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                WHEN attempts >= :max_attempts THEN 'failed'
                ELSE 'queued' END,
              cancelled_at = CASE WHEN cancel_requested_at IS NOT NULL THEN now() END,
              failed_at = CASE WHEN cancel_requested_at IS NULL AND attempts >= :max_attempts
                               THEN now() END,
              error = CASE WHEN cancel_requested_at IS NULL AND attempts >= :max_attempts
                THEN json_build_object('error', json_build_object(
                  'message', 'the job was lost by its worker ' || attempts ||
                             ' times; giving up (the last owner was ' ||
                             coalesce(lease_owner, '?') || ')',
                  'type', 'worker_lost', 'param', NULL, 'code', 'attempts_exhausted'))
                ELSE error END,
              lease_owner = NULL, lease_expires_at = NULL, enqueued_at = NULL
            WHERE id IN ({which})
            RETURNING id, status, model, priority, batch_id, epoch, error, tenant_id
            """  # noqa: S608 - `which` is one of two constant statements above
        )
        with self._db.session() as s:
            rows = s.execute(sql, params).all()
            record_jobs(s, [(r.tenant_id, r.id, r.status, r.batch_id) for r in rows])
        return [Expired(*r[:7]) for r in rows]

    def undispatch(self, job_ids: list[str]) -> None:
        """Batch lines given back unclaimed go back to the feeder (app/liveness.py, row 2)."""
        set_enqueued(self._db, job_ids, None)
