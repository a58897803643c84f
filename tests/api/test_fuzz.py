"""F1: schemathesis against `/openapi.json`, in process, as two tenants: no 5xx, every
response the shape the spec says (status codes, content types, bodies), and the error
shape on every refusal. A short run here; `bash scripts/fuzz.sh` is the long one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from flask import Flask
from hypothesis import given
from schemathesis.checks import positive_data_acceptance

from app.api import create_app
from app.container import build_services
from tests.fuzzing import fuzz_settings
from tests.helpers import Stores, make_settings

FUZZ = fuzz_settings(12)


@pytest.fixture(scope="module")
def fuzz_app(stores: Stores) -> Iterator[Flask]:
    # The sync endpoints would wait for a worker that does not exist here; a short wait
    # returns the 202 the spec allows. The limiter would answer the fuzzer with 429s.
    # Services read their settings when built, so the fixture builds its own from the
    # settings it wants (a patched attribute or settings passed beside services would not
    # reach them).
    services = build_services(make_settings(stores, sync_wait_seconds=0.05, rate_limit_per_minute=0))
    assert not services.limiter.enabled
    yield create_app(services=services)
    services.close()


def fuzz(operation, keys: list[str]) -> None:  # type: ignore[no-untyped-def]
    # An upload's bytes are checked line by line; the spec can only say "binary". A webhook
    # URL is refused unless its host resolves to a public address, which no schema can say.
    # A v2 batch's items are checked line by line as an upload's, and its model_config
    # against what the deployment manages (every field but `model` must be null or default).
    checked_beyond_schema = operation.path == "/v1/files" or (
        operation.method.upper() == "POST"
        and operation.path
        in ("/v1/webhook_endpoints", "/v1/webhook_endpoints/{endpoint_id}", "/v2/batch-completions")
    )
    excluded = [positive_data_acceptance] if checked_beyond_schema else []

    @given(case=operation.as_strategy())
    @FUZZ
    def run(case) -> None:  # type: ignore[no-untyped-def]
        for key in keys:
            case.call_and_validate(headers={"Authorization": f"Bearer {key}"}, excluded_checks=excluded)

    run()


def test_f1_no_5xx_and_no_schema_violation(fuzz_app: Flask, tenant_keys) -> None:  # type: ignore[no-untyped-def]
    schema = schemathesis.openapi.from_wsgi("/openapi.json", fuzz_app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    for operation in operations:
        fuzz(operation, [tenant_keys["a"], tenant_keys["b"]])
