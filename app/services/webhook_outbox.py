"""The webhook outbox's one rule: an event is written in the same transaction as the state
change that causes it, so a committed change always has its events and a rolled-back one
has none. Every place that ends a batch or a single job calls in here:

| event                | written by                                                            |
|----------------------|-----------------------------------------------------------------------|
| batch.failed         | app/services/batch_transitions.py `fail_validating`                   |
| batch.completed, batch.cancelled, batch.expired | app/services/batch_lifecycle.py `_finalize` |
| job.succeeded/failed/cancelled | worker/store.py `finish_many` (FINISH_EVENTS, one statement) |
| job.failed/cancelled | worker/store.py `_release` (lease lapsed), app/services/jobs.py `cancel` |

Only single jobs (`batch_id IS NULL`, sync chat included) have job events; a batch's lines
are reported by the batch's event. One INSERT ... SELECT joins the events with the
tenant's endpoints that asked for their type: a tenant without endpoints costs one index
probe and writes nothing. Event ids are made here (`evt_`, sorting by time), the same for
every endpoint of one event. The deliverer (app/services/webhook_delivery.py) sends them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.domain.webhooks import JOB_EVENT_STATUSES
from app.ids import new_id

_RECORD = text(
    """
    INSERT INTO webhook_deliveries (endpoint_id, event_id, type, subject_id, status, attempts,
                                    created_at, next_attempt_at)
    SELECT e.id, x.event_id, x.type, x.subject_id, 'pending', 0, now(), now()
    FROM json_to_recordset(CAST(:events AS json))
         AS x(event_id text, tenant_id text, type text, subject_id text)
    JOIN webhook_endpoints e ON e.tenant_id = x.tenant_id AND x.type = ANY(e.event_types)
    """
)

# A CTE for a statement whose `done` CTE returns the jobs it ended (id, tenant_id, status,
# batch_id, event_id): their events go out with it, in the same statement.
FINISH_EVENTS = """
    hooks AS (
      INSERT INTO webhook_deliveries (endpoint_id, event_id, type, subject_id, status, attempts,
                                      created_at, next_attempt_at)
      SELECT e.id, d.event_id, 'job.' || d.status, d.id, 'pending', 0, now(), now()
      FROM done d
      JOIN webhook_endpoints e ON e.tenant_id = d.tenant_id AND ('job.' || d.status) = ANY(e.event_types)
      WHERE d.batch_id IS NULL AND d.status IN ('succeeded', 'failed', 'cancelled')
    )
"""


@dataclass(frozen=True)
class Event:
    tenant_id: str
    type: str
    subject_id: str


def new_event_id() -> str:
    return new_id("evt")


def record(s: Session, events: Iterable[Event]) -> None:
    """Write `events` for every endpoint that wants them, inside the caller's transaction."""
    rows = [
        {"event_id": new_event_id(), "tenant_id": e.tenant_id, "type": e.type, "subject_id": e.subject_id}
        for e in events
    ]
    if rows:
        s.execute(_RECORD, {"events": json.dumps(rows)})


def job_event(tenant_id: str, job_id: str, status: str, batch_id: str | None) -> Event | None:
    """The event a job's new status causes: only single jobs that ended have one."""
    if batch_id is not None or status not in JOB_EVENT_STATUSES:
        return None
    return Event(tenant_id, f"job.{status}", job_id)


def record_jobs(s: Session, ended: Iterable[tuple[str, str, str, str | None]]) -> None:
    """`ended`: (tenant_id, job_id, status, batch_id) of jobs this transaction moved."""
    record(s, [e for row in ended if (e := job_event(*row)) is not None])
