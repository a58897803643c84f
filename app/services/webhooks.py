"""Webhook endpoints, the use cases: create (the secret is shown once), read, list, update,
delete, rotate the secret, and list an endpoint's deliveries. The outbox rows are written
by app/services/webhook_outbox.py and sent by app/services/webhook_delivery.py.

Secrets are stored as they are shown (`whsec_...`), unlike API keys (hashed): a key is only
compared, a signing secret must be read back to sign every delivery. Encrypting it with a
key from the same settings would guard against nothing the database's own access control
does not; whoever can read the table can read every tenant's jobs too."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.db import Database
from app.domain.webhooks import DeliveryStatus, EventType, new_secret, secret_hint
from app.errors import InvalidRequest
from app.ids import new_id
from app.models import WebhookDelivery, WebhookEndpoint
from app.schemas.base import unix_time
from app.schemas.webhooks import (
    EventData,
    RotateSecret,
    WebhookDeliveryList,
    WebhookDeliveryObject,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
)
from app.services.addresses import Resolver
from app.services.keys import Principal
from app.services.ownership import load_owned
from app.services.pagination import check_limit, newest_first, page_fields
from app.services.parsing import parse_model
from app.services.quotas import lock_tenant
from app.services.webhook_targets import refusal

log = logging.getLogger("llmq.webhooks")

MAX_PAGE = 100
OLD_SECRET_GRACE = timedelta(hours=24)


def to_endpoint_object(e: WebhookEndpoint) -> WebhookEndpointObject:
    return WebhookEndpointObject(
        id=e.id,
        url=e.url,
        name=e.name,
        event_types=list(e.event_types),
        created_at=unix_time(e.created_at) or 0,
        updated_at=unix_time(e.updated_at),
        signing_secret_hint=secret_hint(e.secret),
    )


def with_secret(e: WebhookEndpoint) -> WebhookEndpointWithSecret:
    return WebhookEndpointWithSecret(**to_endpoint_object(e).model_dump(), signing_secret=e.secret)


def to_delivery_object(d: WebhookDelivery) -> WebhookDeliveryObject:
    pending = d.status == DeliveryStatus.PENDING.value
    return WebhookDeliveryObject(
        id=d.event_id,
        endpoint_id=d.endpoint_id,
        type=EventType(d.type),
        data=EventData(id=d.subject_id),
        created_at=unix_time(d.created_at) or 0,
        status=DeliveryStatus(d.status),
        attempts=d.attempts,
        next_attempt_at=unix_time(d.next_attempt_at) if pending else None,
        last_attempt_at=unix_time(d.last_attempt_at),
        last_status_code=d.last_status_code,
        last_error=d.last_error,
        delivered_at=unix_time(d.delivered_at),
        failed_at=unix_time(d.failed_at),
    )


class WebhookService:
    def __init__(
        self, db: Database, resolve: Resolver, *, allow_private: bool, max_endpoints_per_tenant: int
    ) -> None:
        self._db = db
        self._resolve = resolve
        self._allow_private = allow_private
        self._max_endpoints = max_endpoints_per_tenant

    def _check_url(self, url: str) -> None:
        why = refusal(url, self._resolve, allow_private=self._allow_private)
        if why is not None:
            raise InvalidRequest(f"webhook url refused: {why}", param="url", code="invalid_url")

    def create(self, principal: Principal, payload: Any) -> WebhookEndpointWithSecret:
        """Raises:
        InvalidRequest: bad fields, a URL that may not receive webhooks, or the tenant has
            its maximum number of endpoints.
        """
        req = parse_model(WebhookEndpointCreate, payload)
        self._check_url(req.url)
        now = datetime.now(UTC)
        endpoint = WebhookEndpoint(
            id=new_id("whep"),
            tenant_id=principal.tenant_id,
            url=req.url,
            name=req.name,
            event_types=sorted({t.value for t in req.event_types}),
            secret=new_secret(),
            created_at=now,
            updated_at=now,
        )
        with self._db.session() as s:
            # Counted and inserted under the tenant's lock: two creates cannot both take the
            # last place (a transaction-scoped lock: fine behind PgBouncer).
            lock_tenant(s, principal.tenant_id)
            count = s.scalar(
                select(func.count())
                .select_from(WebhookEndpoint)
                .where(WebhookEndpoint.tenant_id == principal.tenant_id)
            )
            if int(count or 0) >= self._max_endpoints:
                raise InvalidRequest(
                    f"this tenant has {count} webhook endpoints, the most allowed; delete one first",
                    code="webhook_endpoint_limit",
                )
            s.add(endpoint)
        log.info("webhook endpoint created", extra={"endpoint_id": endpoint.id, "tenant": endpoint.tenant_id})
        return with_secret(endpoint)

    def get(self, principal: Principal, endpoint_id: str) -> WebhookEndpointObject:
        """Raises NotFound: no such endpoint for this tenant."""
        with self._db.session() as s:
            return to_endpoint_object(load_owned(s, WebhookEndpoint, endpoint_id, principal.tenant_id))

    def list(self, principal: Principal, *, after: str | None, limit: int) -> WebhookEndpointList:
        check_limit(limit, MAX_PAGE)
        q = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == principal.tenant_id)
        with self._db.session() as s:
            rows, more = newest_first(s, q, WebhookEndpoint.id, after=after, limit=limit)
        data = [to_endpoint_object(e) for e in rows]
        return WebhookEndpointList(data=data, **page_fields(data, more))

    def update(self, principal: Principal, endpoint_id: str, payload: Any) -> WebhookEndpointObject:
        """Change the URL, event types or name; events already written keep their endpoint.

        Raises:
            NotFound: no such endpoint for this tenant.
            InvalidRequest: bad fields or a URL that may not receive webhooks.
        """
        self.get(principal, endpoint_id)  # another tenant's id is a 404 whatever the body
        req = parse_model(WebhookEndpointUpdate, payload)
        if req.url is not None:
            self._check_url(req.url)
        with self._db.session() as s:
            endpoint = self._locked(s, principal, endpoint_id)
            if req.url is not None:
                endpoint.url = req.url
            if req.event_types is not None:
                endpoint.event_types = sorted({t.value for t in req.event_types})
            if req.name is not None:
                endpoint.name = req.name
            endpoint.updated_at = datetime.now(UTC)
            return to_endpoint_object(endpoint)

    def delete(self, principal: Principal, endpoint_id: str) -> WebhookEndpointDeleted:
        """The endpoint and its deliveries, pending ones included, are gone.

        Raises NotFound: no such endpoint for this tenant.
        """
        with self._db.session() as s:
            load_owned(s, WebhookEndpoint, endpoint_id, principal.tenant_id)
            s.execute(delete(WebhookEndpoint).where(WebhookEndpoint.id == endpoint_id))
        log.info("webhook endpoint deleted", extra={"endpoint_id": endpoint_id})
        return WebhookEndpointDeleted(id=endpoint_id)

    def rotate_secret(
        self, principal: Principal, endpoint_id: str, payload: Any
    ) -> WebhookEndpointWithSecret:
        """A new secret, shown once. With `keep_old_secret_active_for_24_hours` the old one
        signs too (a second signature in `webhook-signature`) for 24 hours.

        Raises NotFound: no such endpoint for this tenant.
        """
        self.get(principal, endpoint_id)
        req = parse_model(RotateSecret, payload if payload is not None else {})
        now = datetime.now(UTC)
        with self._db.session() as s:
            endpoint = self._locked(s, principal, endpoint_id)
            if req.keep_old_secret_active_for_24_hours:
                endpoint.previous_secret = endpoint.secret
                endpoint.previous_secret_expires_at = now + OLD_SECRET_GRACE
            else:
                endpoint.previous_secret = None
                endpoint.previous_secret_expires_at = None
            endpoint.secret = new_secret()
            endpoint.updated_at = now
            return with_secret(endpoint)

    def deliveries(
        self,
        principal: Principal,
        endpoint_id: str,
        *,
        status: str | None = None,
        after: str | None = None,
        limit: int = 20,
    ) -> WebhookDeliveryList:
        """An endpoint's events and how their delivery went, newest first.

        Raises:
            NotFound: no such endpoint for this tenant.
            InvalidRequest: an unknown status or a bad limit.
        """
        check_limit(limit, MAX_PAGE)
        if status is not None and status not in {d.value for d in DeliveryStatus}:
            raise InvalidRequest(f"unknown status {status!r}", param="status")
        q = select(WebhookDelivery).where(WebhookDelivery.endpoint_id == endpoint_id)
        if status:
            q = q.where(WebhookDelivery.status == status)
        with self._db.session() as s:
            load_owned(s, WebhookEndpoint, endpoint_id, principal.tenant_id)
            rows, more = newest_first(s, q, WebhookDelivery.event_id, after=after, limit=limit)
        data = [to_delivery_object(d) for d in rows]
        return WebhookDeliveryList(data=data, **page_fields(data, more))

    @staticmethod
    def _locked(s: Session, principal: Principal, endpoint_id: str) -> WebhookEndpoint:
        endpoint = load_owned(s, WebhookEndpoint, endpoint_id, principal.tenant_id)
        s.refresh(endpoint, with_for_update=True)
        return endpoint
