"""Webhook endpoints and deliveries on the wire: OpenAI's `/webhook_endpoints` shapes (the
`openai` SDK's `client.webhooks.create/retrieve/update/list/delete/rotate_secret` work
against llmq), plus the deliveries list (an extension)."""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field

from app.domain.webhooks import DeliveryStatus, EventType
from app.schemas.base import WireModel

MAX_URL_LENGTH = 2048


class WebhookEndpointCreate(WireModel):
    url: str = Field(min_length=1, max_length=MAX_URL_LENGTH)
    # OpenAI's names; `events` and `description` are accepted as well.
    event_types: list[EventType] = Field(
        min_length=1, max_length=len(EventType), validation_alias=AliasChoices("event_types", "events")
    )
    name: str = Field(default="", max_length=256, validation_alias=AliasChoices("name", "description"))


class WebhookEndpointUpdate(WireModel):
    url: str | None = Field(default=None, min_length=1, max_length=MAX_URL_LENGTH)
    event_types: list[EventType] | None = Field(
        default=None,
        min_length=1,
        max_length=len(EventType),
        validation_alias=AliasChoices("event_types", "events"),
    )
    name: str | None = Field(
        default=None, max_length=256, validation_alias=AliasChoices("name", "description")
    )


class RotateSecret(WireModel):
    keep_old_secret_active_for_24_hours: bool = False


class WebhookEndpointObject(WireModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    name: str
    event_types: list[str]
    created_at: int
    updated_at: int | None = None
    signing_secret_hint: str


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """Returned by create and rotate only: the one time the secret is shown."""

    signing_secret: str


class WebhookEndpointList(WireModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class WebhookEndpointDeleted(WireModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class EventData(WireModel):
    id: str


class WebhookEvent(WireModel):
    """The body each delivery POSTs (built byte for byte by app/domain/webhooks.event_body)."""

    id: str
    object: Literal["event"] = "event"
    type: EventType
    created_at: int
    data: EventData


class WebhookDeliveryObject(WireModel):
    """One event for one endpoint, and how its delivery is going. `id` is the event id (the
    `webhook-id` header)."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    endpoint_id: str
    type: EventType
    data: EventData
    created_at: int
    status: DeliveryStatus
    attempts: int
    next_attempt_at: int | None = None
    last_attempt_at: int | None = None
    last_status_code: int | None = None
    last_error: str | None = None
    delivered_at: int | None = None
    failed_at: int | None = None


class WebhookDeliveryList(WireModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool
