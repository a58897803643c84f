"""Job state transitions the worker makes, each one guarded.

The claim bumps `epoch`; every later write says `WHERE epoch = :mine AND status =
'running'`, so a worker that lost its lease (paused, partitioned, too slow) cannot
overwrite the result of the worker that took over.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, update

from app.db import Database
from app.models import Job, JobStatus

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


@dataclass(frozen=True)
class Expired:
    job_id: str
    status: str
    model: str
    priority: int
    batch_id: str | None
    epoch: int = 0
    error: dict[str, Any] | None = None


class JobStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    def claim(self, job_id: str, owner: str, lease_seconds: float, max_attempts: int) -> Claim | None:
        """Take the job if it is queued, or running under an expired lease, and has
        attempts left. None means someone else has it, or it is already over."""
        lease = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, lease_seconds)
        stmt = (
            update(Job)
            .where(
                Job.id == job_id,
                Job.attempts < max_attempts,
                Job.cancel_requested_at.is_(None),
                (Job.status == JobStatus.QUEUED.value)
                | ((Job.status == _RUNNING) & (Job.lease_expires_at < func.now())),
            )
            .values(
                status=_RUNNING,
                epoch=Job.epoch + 1,
                attempts=Job.attempts + 1,
                lease_owner=owner,
                lease_expires_at=lease,
                started_at=func.coalesce(Job.started_at, func.now()),
            )
            .returning(
                Job.epoch,
                Job.attempts,
                Job.kind,
                Job.model,
                Job.priority,
                Job.tenant_id,
                Job.request,
                Job.created_at,
                Job.batch_id,
            )
        )
        with self._db.session() as s:
            row = s.execute(stmt).first()
        if row is None:
            return None
        return Claim(job_id, *row)

    def _finish(self, job_id: str, epoch: int, values: dict[str, Any]) -> bool:
        stmt = (
            update(Job)
            .where(Job.id == job_id, Job.epoch == epoch, Job.status == _RUNNING)
            .values({"finished_by": Job.lease_owner, "lease_owner": None, "lease_expires_at": None, **values})
            .returning(Job.id)
        )
        with self._db.session() as s:
            return s.execute(stmt).first() is not None

    def succeed(
        self,
        job_id: str,
        epoch: int,
        *,
        response: dict[str, Any],
        usage: dict[str, Any],
        generation_stats: dict[str, Any],
        power_usage: dict[str, Any] | None,
        events: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Record the result. False when the fence refused it (someone else owns the job)."""
        return self._finish(
            job_id,
            epoch,
            {
                "status": JobStatus.SUCCEEDED.value,
                "succeeded_at": func.now(),
                "response": response,
                "usage": usage,
                "generation_stats": generation_stats,
                "power_usage": power_usage,
                "error": None,
                "events": events,
            },
        )

    def fail(
        self, job_id: str, epoch: int, error: dict[str, Any], events: list[dict[str, Any]] | None = None
    ) -> bool:
        return self._finish(
            job_id,
            epoch,
            {"status": JobStatus.FAILED.value, "failed_at": func.now(), "error": error, "events": events},
        )

    def cancel(
        self,
        job_id: str,
        epoch: int,
        *,
        response: dict[str, Any] | None,
        usage: dict[str, Any] | None,
        generation_stats: dict[str, Any] | None,
        events: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Record a cancel with the partial text generated so far."""
        return self._finish(
            job_id,
            epoch,
            {
                "status": JobStatus.CANCELLED.value,
                "cancelled_at": func.now(),
                "response": response,
                "usage": usage,
                "generation_stats": generation_stats,
                "events": events,
            },
        )

    def release(self, job_id: str, epoch: int) -> bool:
        """Give the job back to the queue (worker shutting down or engine dead)."""
        return self._finish(
            job_id, epoch, {"status": JobStatus.QUEUED.value, "enqueued_at": None, "finished_by": None}
        )

    def extend_leases(self, owner: str, lease_seconds: float) -> dict[str, tuple[int, bool]]:
        """Extend every lease `owner` holds; returns {job_id: (epoch, cancel_requested)}."""
        stmt = (
            update(Job)
            .where(Job.lease_owner == owner, Job.status == _RUNNING)
            .values(lease_expires_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, lease_seconds))
            .returning(Job.id, Job.epoch, Job.cancel_requested_at)
        )
        with self._db.session() as s:
            return {r.id: (r.epoch, r.cancel_requested_at is not None) for r in s.execute(stmt)}

    def status(self, job_id: str) -> str | None:
        with self._db.session() as s:
            return s.scalar(select(Job.status).where(Job.id == job_id))

    # --- sweeper ---------------------------------------------------------------------

    def expire_leases(self, max_attempts: int) -> list[Expired]:
        """Running jobs whose owner stopped renewing: back to the queue, or failed when
        attempts are spent, or cancelled when a cancel was asked for."""
        sql = text(
            """
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
            WHERE id IN (
              SELECT id FROM jobs WHERE status = 'running' AND lease_expires_at < now()
              ORDER BY lease_expires_at LIMIT 1000 FOR UPDATE SKIP LOCKED)
            RETURNING id, status, model, priority, batch_id, epoch, error
            """
        )
        with self._db.session() as s:
            rows = s.execute(sql, {"max_attempts": max_attempts}).all()
        return [Expired(*r) for r in rows]

    def stale_queued(self, grace_seconds: float, limit: int = 1000) -> list[tuple[Expired, bool]]:
        """Queued jobs with no message yet (`enqueued_at` null: released or re-queued), and
        queued jobs whose message was last confirmed over `grace_seconds` ago; the flag
        says which (True: never sent), the caller verifies the others' markers."""
        sql = text(
            """
            SELECT id, status, model, priority, batch_id, enqueued_at IS NULL FROM jobs
            WHERE status = 'queued'
              AND (enqueued_at IS NULL OR enqueued_at < now() - make_interval(secs => :grace))
            ORDER BY enqueued_at NULLS FIRST LIMIT :limit
            """
        )
        with self._db.session() as s:
            rows = s.execute(sql, {"grace": grace_seconds, "limit": limit}).all()
        return [(Expired(*r[:5]), bool(r[5])) for r in rows]

    def mark_enqueued(self, job_ids: list[str]) -> None:
        if not job_ids:
            return
        with self._db.session() as s:
            s.execute(
                update(Job)
                .where(Job.id.in_(job_ids), Job.status == JobStatus.QUEUED.value)
                .values(enqueued_at=func.now())
            )
