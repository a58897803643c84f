"""`llmq webhooks create|list|delete|rotate|deliveries`: webhook endpoints from the command line."""

from __future__ import annotations

from typing import Any

from app.cli.client import LlmqClient
from app.domain.webhooks import EventType


def create(client: LlmqClient, url: str, events: list[str] | None, name: str) -> dict[str, Any]:
    body = {"url": url, "event_types": events or [t.value for t in EventType], "name": name}
    endpoint = client.webhooks("POST", json=body)
    print(f"webhook endpoint {endpoint['id']} -> {endpoint['url']}")
    print(f"  events: {', '.join(endpoint['event_types'])}")
    print(f"  signing secret (shown once): {endpoint['signing_secret']}")
    return endpoint


def list_endpoints(client: LlmqClient) -> None:
    after = None
    while True:
        page = client.webhooks("GET", params={"limit": 100, **({"after": after} if after else {})})
        for e in page["data"]:
            print(f"{e['id']}  {e['url']}  {','.join(e['event_types'])}  {e['signing_secret_hint']}")
        if not page["has_more"]:
            return
        after = page["last_id"]


def rotate(client: LlmqClient, endpoint_id: str, *, keep_old: bool) -> dict[str, Any]:
    body = {"keep_old_secret_active_for_24_hours": keep_old}
    endpoint = client.webhooks("POST", f"/{endpoint_id}/rotate_secret", json=body)
    print(f"new signing secret for {endpoint_id} (shown once): {endpoint['signing_secret']}")
    if keep_old:
        print("  the old secret signs too for 24 hours")
    return endpoint


def deliveries(client: LlmqClient, endpoint_id: str, *, status: str | None, limit: int) -> None:
    params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
    page = client.webhooks("GET", f"/{endpoint_id}/deliveries", params=params)
    for d in page["data"]:
        error = f"  {d['last_error']}" if d["last_error"] and d["status"] != "delivered" else ""
        print(
            f"{d['id']}  {d['type']:<16} {d['data']['id']}  {d['status']:<9} attempts={d['attempts']}{error}"
        )
