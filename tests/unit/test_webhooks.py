"""Webhook signing, payload, retry schedule and destinations, checked against the official
verifiers: the `openai` SDK's `webhooks.unwrap` and the `standardwebhooks` package."""

from __future__ import annotations

import base64
import ipaddress
import json
import time

import openai
import pytest
import standardwebhooks
from openai.types.webhooks import BatchCompletedWebhookEvent

from app.domain.webhooks import (
    SECRET_BYTES,
    RetrySchedule,
    event_body,
    new_secret,
    secret_hint,
    signed_headers,
)
from app.schemas.webhooks import WebhookEvent
from app.services.addresses import UnresolvableHost
from app.services.webhook_targets import Refused, pin, refusal

SDK = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def _signed(
    secret: str, *, body: bytes | None = None, old: str | None = None
) -> tuple[bytes, dict[str, str]]:
    body = body or event_body("evt_01", "batch.completed", 1_700_000_000, "batch_abc")
    secrets_ = [secret] + ([old] if old else [])
    return body, signed_headers(secrets_, "evt_01", int(time.time()), body)


def test_secret_is_standard_webhooks_form() -> None:
    secret = new_secret()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == SECRET_BYTES
    assert new_secret() != secret
    assert secret_hint(secret).endswith(secret[-4:]) and secret[6:-4] not in secret_hint(secret)


def test_openai_sdk_unwrap_verifies_and_parses() -> None:
    secret = new_secret()
    body, headers = _signed(secret)
    event = SDK.webhooks.unwrap(body, headers, secret=secret)
    assert isinstance(event, BatchCompletedWebhookEvent)
    assert event.id == "evt_01" and event.data.id == "batch_abc" and event.object == "event"


def test_standardwebhooks_verifies() -> None:
    secret = new_secret()
    body, headers = _signed(secret)
    assert standardwebhooks.Webhook(secret).verify(body, headers)["data"] == {"id": "batch_abc"}


def test_a_job_event_verifies_with_both() -> None:
    secret = new_secret()
    body, headers = _signed(secret, body=event_body("evt_02", "job.succeeded", 1_700_000_000, "job_x"))
    headers["webhook-id"] = "evt_01"  # signed under this id
    SDK.webhooks.verify_signature(body, headers, secret=secret)
    assert standardwebhooks.Webhook(secret).verify(body, headers)["type"] == "job.succeeded"


@pytest.mark.parametrize("change", ["body", "id", "timestamp", "secret"])
def test_tampering_fails_both_verifiers(change: str) -> None:
    secret = new_secret()
    body, headers = _signed(secret)
    if change == "body":
        body = body.replace(b"batch_abc", b"batch_abd")
    elif change == "id":
        headers["webhook-id"] = "evt_02"
    elif change == "timestamp":
        headers["webhook-timestamp"] = str(int(headers["webhook-timestamp"]) - 1)
    else:
        secret = new_secret()
    with pytest.raises(openai.InvalidWebhookSignatureError):
        SDK.webhooks.unwrap(body, headers, secret=secret)
    with pytest.raises(standardwebhooks.WebhookVerificationError):
        standardwebhooks.Webhook(secret).verify(body, headers)


def test_after_a_rotation_with_grace_both_secrets_verify() -> None:
    old, new = new_secret(), new_secret()
    body, headers = _signed(new, old=old)
    assert len(headers["webhook-signature"].split(" ")) == 2
    for secret in (old, new):
        SDK.webhooks.verify_signature(body, headers, secret=secret)
        standardwebhooks.Webhook(secret).verify(body, headers)


def test_payload_has_openais_shape_and_is_compact() -> None:
    body = event_body("evt_01", "batch.failed", 1_700_000_000, "batch_abc")
    assert json.loads(body) == {
        "id": "evt_01",
        "object": "event",
        "type": "batch.failed",
        "created_at": 1_700_000_000,
        "data": {"id": "batch_abc"},
    }
    assert b" " not in body
    WebhookEvent.model_validate_json(body)


def _timeline(schedule: RetrySchedule) -> list[tuple[float, float]]:
    """(age at the attempt, wait after it) for every failed attempt until it gives up."""
    age, attempts, out = 0.0, 0, []
    while True:
        attempts += 1
        wait = schedule.delay(attempts, age)
        if wait is None:
            return out
        out.append((age, wait))
        age += wait


def test_schedule_starts_at_seconds_doubles_and_caps_at_two_minutes_in_the_first_hour() -> None:
    steps = _timeline(RetrySchedule())
    assert [w for _, w in steps[:6]] == [5, 10, 20, 40, 80, 120]
    first_hour = [w for age, w in steps if age < 3600]
    assert max(first_hour) <= 120
    assert len(first_hour) > 25  # retried often while the receiver may just be restarting


def test_schedule_lasts_three_days_then_gives_up() -> None:
    schedule = RetrySchedule()
    steps = _timeline(schedule)
    last_age, last_wait = steps[-1]
    assert last_age + last_wait == pytest.approx(3 * 86400)  # a last attempt at the end
    assert max(w for _, w in steps) <= 3600
    assert schedule.delay(200, 3 * 86400) is None
    assert len(steps) < 200


def test_retry_after_lengthens_the_wait_within_the_cap() -> None:
    schedule = RetrySchedule()
    assert schedule.delay(1, 0, retry_after=60) == 60
    assert schedule.delay(1, 0, retry_after=10_000) == 120
    assert schedule.delay(1, 0, retry_after=1) == 5


def test_shortened_schedule_for_tests() -> None:
    schedule = RetrySchedule(base=0.2, cap=1, lifetime=5)
    steps = _timeline(schedule)
    assert steps[0][1] == 0.2 and max(w for _, w in steps) <= 1
    assert sum(w for _, w in steps) == pytest.approx(5)


PUBLIC = ipaddress.ip_address("93.184.216.34")
PRIVATE = ipaddress.ip_address("10.1.2.3")


def test_private_and_odd_destinations_are_refused_unless_allowed() -> None:
    def resolve(_host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        return [PRIVATE]

    for url in (
        "http://127.0.0.1/x",
        "https://10.0.0.1/",
        "http://[::1]:8080/",
        "http://localhost/",
        "http://inside.example/",
    ):
        assert refusal(url, resolve, allow_private=False) is not None, url
        assert refusal(url, resolve, allow_private=True) is None, url
    for url in ("ftp://example.com/", "data:,x", "file:///etc/passwd", "http:///x", "http://h:port/"):
        assert refusal(url, resolve, allow_private=True) is not None, url


def test_attempt_connects_to_the_address_that_was_checked() -> None:
    target = pin("https://hooks.example.com:8443/in?x=1", lambda _h: [PUBLIC], allow_private=False)
    assert target.url == "https://93.184.216.34:8443/in?x=1"
    assert target.headers == {"host": "hooks.example.com:8443"}
    assert target.extensions == {"sni_hostname": "hooks.example.com"}


def test_a_name_that_now_resolves_privately_is_refused_at_delivery() -> None:
    answers = iter([[PUBLIC], [PRIVATE]])
    assert refusal("http://rebind.example/", lambda _h: next(answers), allow_private=False) is None
    with pytest.raises(Refused, match="not allowed"):
        pin("http://rebind.example/", lambda _h: [PRIVATE], allow_private=False)

    def gone(_host: str) -> list[ipaddress.IPv4Address]:
        raise UnresolvableHost("does not resolve")

    with pytest.raises(Refused):
        pin("http://gone.example/", gone, allow_private=False)
