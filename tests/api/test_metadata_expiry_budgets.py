"""Issue 13, items 5 and 6: `metadata` on single jobs with OpenAI's limits and list filters;
`expires_after` on uploads and `output_expires_after` on batches (files deleted, the lines'
texts cleared, counts and usage kept); batch token budgets per tenant and model."""

from __future__ import annotations

import io
import json
import secrets
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import text

from app.api import create_app
from app.cli.main import main as cli
from app.container import Services, build_services
from app.errors import RateLimited
from app.services.batch_lifecycle import BatchLifecycle
from app.services.expiry import FileExpiry
from tests.helpers import Stores, auth, create, jsonl, line, make_settings, upload


def body(**fields: Any) -> dict[str, Any]:
    return {"model": "api-only", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


@pytest.fixture
def tenant(services: Services) -> tuple[str, str]:
    name = f"tenant-meta-{secrets.token_hex(3)}"
    return name, services.keys.create_key(name)


def batch_of(client: FlaskClient, key: str, lines: list[dict[str, Any]], **extra: Any):  # type: ignore[no-untyped-def]
    r = upload(client, key, jsonl(lines))
    assert r.status_code == 200, r.get_json()
    return create(client, key, r.get_json()["id"], **extra)


# --- metadata ---------------------------------------------------------------------------


def test_job_metadata_is_stored_returned_and_filtered(client: FlaskClient, tenant, tenant_keys) -> None:
    key = tenant[1]
    ids = {}
    for name, meta in {
        "a": {"team": "red", "env": "prod"},
        "b": {"team": "red", "env": "dev"},
        "c": {"team": "blue", "env": "prod"},
        "none": None,
    }.items():
        r = client.post("/v2/jobs", json=body(metadata=meta) if meta else body(), headers=auth(key))
        assert r.status_code == 202 and r.get_json()["metadata"] == meta
        ids[name] = r.get_json()["id"]
    assert client.get(f"/v2/jobs/{ids['a']}", headers=auth(key)).get_json()["metadata"] == {
        "team": "red",
        "env": "prod",
    }
    # Another tenant's job with the same metadata is never listed.
    other = client.post("/v2/jobs", json=body(metadata={"team": "red"}), headers=auth(tenant_keys["b"]))
    assert other.status_code == 202

    def listed(query: str) -> list[str]:
        r = client.get(f"/v2/jobs?{query}", headers=auth(key))
        assert r.status_code == 200, r.get_json()
        return [j["id"] for j in r.get_json()["data"]]

    assert listed("metadata[team]=red") == [ids["b"], ids["a"]]
    assert listed("metadata[team]=red&metadata[env]=prod") == [ids["a"]]
    assert listed("metadata[env]=prod&status=queued") == [ids["c"], ids["a"]]
    assert listed("metadata[team]=green") == []
    assert listed("metadata[team]=red&limit=1") == [ids["b"]]


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("metadata=x", "metadata"),
        ("metadata[]=x", "metadata[]"),
        ("metadata[k]=a&metadata[k]=b", "metadata[k]"),
        ("metadata[" + "k" * 65 + "]=x", "metadata[" + "k" * 65 + "]"),
        ("metadata[k]=" + "v" * 513, "metadata[k]"),
        ("&".join(f"metadata[k{i}]=v" for i in range(17)), "metadata"),
    ],
)
@pytest.mark.parametrize("path", ["/v2/jobs", "/v1/batches"])
def test_bad_metadata_filters_are_400s_naming_the_param(
    client: FlaskClient, tenant, path: str, query: str, param: str
) -> None:
    r = client.get(f"{path}?{query}", headers=auth(tenant[1]))
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("metadata", "param"),
    [
        ({f"k{i}": "v" for i in range(17)}, "metadata"),
        ({"k" * 65: "v"}, "metadata." + "k" * 64),
        ({"k": "v" * 513}, "metadata.k"),
        ({"k": 1}, "metadata.k"),
    ],
)
@pytest.mark.parametrize("path", ["/v2/jobs", "/v1/chat/completions"])
def test_metadata_past_openais_limits_is_a_400(
    client: FlaskClient, tenant, path: str, metadata: dict[str, Any], param: str
) -> None:
    r = client.post(path, json=body(metadata=metadata), headers=auth(tenant[1]))
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["param"] == param


def test_sixteen_pairs_at_the_limits_are_accepted(client: FlaskClient, tenant) -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = client.post("/v2/jobs", json=body(metadata=metadata), headers=auth(tenant[1]))
    assert r.status_code == 202 and r.get_json()["metadata"] == metadata


def test_batch_lines_with_bad_metadata_refuse_the_upload(client: FlaskClient, tenant) -> None:
    r = upload(client, tenant[1], jsonl([line(1), line(2, metadata={"k": "v" * 513})]))
    assert r.status_code == 400
    assert r.get_json()["errors"]["data"][0]["line"] == 2


def test_batches_are_filtered_by_metadata(client: FlaskClient, tenant) -> None:
    key = tenant[1]
    made = {}
    for name, meta in {"x": {"run": "1", "kind": "eval"}, "y": {"run": "2", "kind": "eval"}}.items():
        r = batch_of(client, key, [line(1)], metadata=meta)
        assert r.status_code == 200, r.get_json()
        made[name] = r.get_json()["id"]
    assert batch_of(client, key, [line(1)]).status_code == 200

    def listed(query: str) -> list[str]:
        r = client.get(f"/v1/batches?{query}", headers=auth(key))
        assert r.status_code == 200, r.get_json()
        return [b["id"] for b in r.get_json()["data"]]

    assert listed("metadata[kind]=eval") == [made["y"], made["x"]]
    assert listed("metadata[kind]=eval&metadata[run]=1") == [made["x"]]
    assert listed("metadata[run]=3") == []


def test_the_list_queries_can_use_the_metadata_indexes(services: Services, tenant) -> None:
    """With sequential scans priced out, the filtered listing is planned on an index."""
    principal = services.keys.authenticate(tenant[1])
    statements: list[str] = []
    with services.db.session() as s:
        s.execute(text("SET LOCAL enable_seqscan = off"))
        for table in ("jobs", "batches"):
            plan = s.execute(
                text(
                    f"EXPLAIN SELECT id FROM {table} WHERE tenant_id = :t AND metadata IS NOT NULL "
                    "AND CAST(metadata AS jsonb) @> CAST(:f AS jsonb) ORDER BY id DESC LIMIT 21"
                ),
                {"t": principal.tenant_id, "f": '{"team": "red"}'},
            ).all()
            statements.append("\n".join(r[0] for r in plan))
    for plan in statements:
        # Without an index on the tenant or the metadata, a disabled Seq Scan is all there is.
        assert "Seq Scan" not in plan and "Index Cond" in plan, plan


# --- expiry -----------------------------------------------------------------------------


def upload_expiring(  # type: ignore[no-untyped-def]
    client: FlaskClient, key: str, form: dict[str, Any], lines: list[dict[str, Any]] | None = None
):
    return client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(jsonl(lines or [line(1)])), "in.jsonl"), **form},
        headers=auth(key),
        content_type="multipart/form-data",
    )


def test_uploads_take_expires_after_as_the_sdks_send_it(client: FlaskClient, tenant) -> None:
    key = tenant[1]
    r = upload_expiring(
        client, key, {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    )
    assert r.status_code == 200, r.get_json()
    f = r.get_json()
    assert f["expires_at"] == f["created_at"] + 3600
    got = client.get(f"/v1/files/{f['id']}", headers=auth(key)).get_json()
    assert got["expires_at"] == f["expires_at"]
    r = upload_expiring(
        client, key, {"expires_after": json.dumps({"anchor": "created_at", "seconds": 86400})}
    )
    assert r.get_json()["expires_at"] == r.get_json()["created_at"] + 86400
    assert upload(client, key, jsonl([line(1)])).get_json()["expires_at"] is None


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after.seconds"),
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
            "expires_after.seconds",
        ),
        (
            {"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
            "expires_after.anchor",
        ),
        ({"expires_after[seconds]": "3600"}, "expires_after.anchor"),
        ({"expires_after": "{"}, "expires_after"),
    ],
)
def test_bad_expires_after_is_a_400(client: FlaskClient, tenant, form: dict[str, str], param: str) -> None:
    r = upload_expiring(client, tenant[1], form)
    assert r.status_code == 400, r.get_json()
    assert r.get_json()["error"]["param"] == param


def test_bad_output_expires_after_is_a_400(client: FlaskClient, tenant) -> None:
    r = batch_of(client, tenant[1], [line(1)], output_expires_after={"anchor": "created_at", "seconds": 60})
    assert r.status_code == 400 and r.get_json()["error"]["param"] == "output_expires_after.seconds"


def finish(services: Services, batch_id: str) -> None:
    """Line 1 succeeds with usage, line 2 fails, as a worker would leave them; then the
    batch is finalized."""
    with services.db.session() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', succeeded_at = now(), epoch = epoch + 1, "
                'response = CAST(:r AS json), events = CAST(\'[{"type": "end"}]\' AS json), '
                "usage = CAST(:u AS jsonb) WHERE batch_id = :b AND line_no = 1"
            ),
            {
                "b": batch_id,
                "r": json.dumps(
                    {"object": "chat.completion", "choices": [{"message": {"content": "secret"}}]}
                ),
                "u": json.dumps({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}),
            },
        )
        s.execute(
            text(
                "UPDATE jobs SET status = 'failed', failed_at = now(), epoch = epoch + 1, "
                "error = CAST(:e AS json) WHERE batch_id = :b AND line_no = 2"
            ),
            {"b": batch_id, "e": json.dumps({"error": {"message": "bad", "type": "invalid_request_error"}})},
        )
    assert (
        BatchLifecycle(services.db, services.queue, services.events, window=64, chunk=8).finalize_done() >= 1
    )


def test_expired_output_files_go_and_take_the_texts_but_not_the_counts(
    client: FlaskClient, services: Services, tenant
) -> None:
    key = tenant[1]
    r = batch_of(
        client, key, [line(1), line(2)], output_expires_after={"anchor": "created_at", "seconds": 7200}
    )
    assert r.status_code == 200, r.get_json()
    batch_id = r.get_json()["id"]
    finish(services, batch_id)
    before = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert before["status"] == "completed"
    assert before["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    files = [before["output_file_id"], before["error_file_id"]]
    for file_id in files:
        f = client.get(f"/v1/files/{file_id}", headers=auth(key)).get_json()
        assert f["expires_at"] == f["created_at"] + 7200
    assert b"secret" in client.get(f"/v1/files/{files[0]}/content", headers=auth(key)).data

    expiry = FileExpiry(services.db, chunk=1)
    expiry.expire_due(datetime.now(UTC) + timedelta(seconds=7000))  # not yet
    assert all(client.get(f"/v1/files/{f}", headers=auth(key)).status_code == 200 for f in files)
    report = expiry.expire_due(datetime.now(UTC) + timedelta(seconds=7201))
    assert report.files >= 2 and report.lines_cleared >= 2

    for file_id in files:
        assert client.get(f"/v1/files/{file_id}", headers=auth(key)).status_code == 404
        assert client.get(f"/v1/files/{file_id}/content", headers=auth(key)).status_code == 404
    after = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).get_json()
    assert after["request_counts"] == before["request_counts"]
    assert after["usage"] == before["usage"] and after["usage"]["input_tokens"] == 7
    with services.db.session() as s:
        rows = s.execute(
            text(
                "SELECT request::text AS request, response, events, status, usage FROM jobs "
                "WHERE batch_id = :b ORDER BY line_no"
            ),
            {"b": batch_id},
        ).all()
    assert [(r.request, r.response, r.events) for r in rows] == [("{}", None, None)] * 2
    assert [r.status for r in rows] == ["succeeded", "failed"] and rows[0].usage["prompt_tokens"] == 7
    # The input file had no expiry of its own: it stays.
    assert client.get(f"/v1/files/{before['input_file_id']}", headers=auth(key)).status_code == 200


def test_an_expired_upload_is_deleted_with_its_lines(client: FlaskClient, services: Services, tenant) -> None:
    key = tenant[1]
    r = upload_expiring(
        client, key, {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    )
    file_id = r.get_json()["id"]
    with services.db.session() as s:
        s.execute(
            text("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = :f"), {"f": file_id}
        )
    FileExpiry(services.db).expire_due()
    assert client.get(f"/v1/files/{file_id}", headers=auth(key)).status_code == 404
    with services.db.session() as s:
        assert s.scalar(text("SELECT count(*) FROM file_lines WHERE file_id = :f"), {"f": file_id}) == 0


def test_a_child_batch_keeps_its_parents_output_expiry(
    client: FlaskClient, services: Services, tenant
) -> None:
    key = tenant[1]
    r = batch_of(
        client, key, [line(1), line(2)], output_expires_after={"anchor": "created_at", "seconds": 3600}
    )
    batch_id = r.get_json()["id"]
    finish(services, batch_id)
    child = client.post(f"/v1/batches/{batch_id}/retry", headers=auth(key))
    assert child.status_code == 200, child.get_json()
    with services.db.session() as s:
        seconds = s.scalar(
            text("SELECT output_expires_after FROM batches WHERE id = :b"), {"b": child.get_json()["id"]}
        )
    assert seconds == 3600
    with services.db.session() as s:  # the child's lines keep the figures counted at upload
        figures = (
            s.execute(
                text(
                    "SELECT j.budget_tokens FROM jobs j WHERE j.batch_id = :b "
                    "UNION ALL SELECT j.budget_tokens FROM jobs j WHERE j.batch_id = :p AND j.line_no = 2"
                ),
                {"b": child.get_json()["id"], "p": batch_id},
            )
            .scalars()
            .all()
        )
    assert len(figures) == 2 and figures[0] == figures[1]


def test_a_batch_whose_input_expired_cannot_be_retried(
    client: FlaskClient, services: Services, tenant
) -> None:
    key = tenant[1]
    form = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    file_id = upload_expiring(client, key, form, [line(1), line(2)]).get_json()["id"]
    batch_id = create(client, key, file_id).get_json()["id"]
    finish(services, batch_id)
    with services.db.session() as s:
        s.execute(
            text("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = :f"), {"f": file_id}
        )
    FileExpiry(services.db).expire_due()
    r = client.post(f"/v1/batches/{batch_id}/retry", headers=auth(key))
    assert r.status_code == 409 and r.get_json()["error"]["code"] == "input_file_gone"


# --- token budgets ----------------------------------------------------------------------


def test_an_upload_counts_prompts_with_the_tokenizer_only_under_a_budget(
    client: FlaskClient, services: Services, tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counting each line with the model's tokenizer is most of an upload's time: it is done
    only while the tenant has a batch token budget; without one a line's figure is the
    estimate from its bytes."""
    name, key = tenant
    counted: list[str] = []

    def count(model: Any) -> Any:
        return lambda r: counted.append(r.model) or 7

    monkeypatch.setattr(services.models, "prompt_counter", count)
    lines = [line(i, max_tokens=100) for i in range(1, 4)]

    def figures() -> list[int]:
        file_id = upload(client, key, jsonl(lines)).get_json()["id"]
        with services.db.session() as s:
            return list(
                s.scalars(
                    text("SELECT tokens FROM file_lines WHERE file_id = :f ORDER BY line_no"), {"f": file_id}
                ).all()
            )

    assert all(100 < t < 130 for t in figures()) and counted == []  # no budget: estimated
    services.keys.set_batch_token_budget(name, 1_000_000)
    assert figures() == [107, 107, 107] and len(counted) == 3  # the model's own count


def test_a_batch_over_the_token_budget_is_a_429_saying_what_is_free(
    client: FlaskClient, services: Services, tenant
) -> None:
    name, key = tenant
    # Each line: "hi N" prompt estimated from its messages' bytes, plus max_tokens 100.
    lines = [line(i, max_tokens=100) for i in range(1, 4)]
    r = upload(client, key, jsonl(lines))
    file_id = r.get_json()["id"]
    with services.db.session() as s:
        per_line = s.scalars(
            text("SELECT tokens FROM file_lines WHERE file_id = :f ORDER BY line_no"), {"f": file_id}
        ).all()
    assert all(100 < t < 130 for t in per_line)
    needed = sum(per_line)
    services.keys.set_batch_token_budget(name, needed + 10)

    first = create(client, key, file_id)
    assert first.status_code == 200, first.get_json()
    second = create(client, key, file_id)
    assert second.status_code == 429
    error = second.get_json()["error"]
    assert error["code"] == "token_limit_exceeded" and error["type"] == "rate_limit_error"
    assert (
        f"needs {needed} tokens for model 'api-only' but 10 of the tenant's {needed + 10}" in error["message"]
    )
    assert second.headers.get("Retry-After")

    # Lines that end give their tokens back, one by one.
    batch_id = first.get_json()["id"]
    with services.db.session() as s:
        s.execute(
            text(
                "UPDATE jobs SET status = 'succeeded', epoch = epoch + 1 WHERE batch_id = :b AND line_no = 1"
            ),
            {"b": batch_id},
        )
    again = create(client, key, file_id)
    assert again.status_code == 429
    assert f"but {10 + per_line[0]} of" in again.get_json()["error"]["message"]
    assert client.post(f"/v1/batches/{batch_id}/cancel", headers=auth(key)).status_code == 200
    assert create(client, key, file_id).status_code == 200


def test_the_budget_is_per_model_and_zero_is_no_limit(
    client: FlaskClient, services: Services, tenant
) -> None:
    name, key = tenant
    services.keys.set_batch_token_budget(name, 0)
    r = upload(client, key, jsonl([line(1, max_tokens=1000)]))
    for _ in range(3):
        assert create(client, key, r.get_json()["id"]).status_code == 200
    services.keys.set_batch_token_budget(name, 500)
    # 3,000 tokens of api-only are held; another model's batch has its own 500.
    held = create(client, key, r.get_json()["id"])
    assert held.status_code == 429 and "but 0 of" in held.get_json()["error"]["message"]
    with services.db.session() as s:
        s.execute(text("UPDATE jobs SET model = 'other-model' WHERE tenant_id = :t"), {"t": name})
    assert (
        create(
            client, key, upload(client, key, jsonl([line(1, max_tokens=300)])).get_json()["id"]
        ).status_code
        == 200
    )


def test_the_default_budget_comes_from_the_setting(stores: Stores) -> None:
    services = build_services(make_settings(stores, batch_token_budget=50))
    try:
        client = create_app(services=services).test_client()
        name = f"tenant-budget-{secrets.token_hex(3)}"
        key = services.keys.create_key(name)
        r = upload(client, key, jsonl([line(1, max_tokens=100)]))
        refused = create(client, key, r.get_json()["id"])
        assert refused.status_code == 429 and "of the tenant's 50 " in refused.get_json()["error"]["message"]
        services.keys.set_batch_token_budget(name, 1000)  # the tenant's own wins
        assert create(client, key, r.get_json()["id"]).status_code == 200
    finally:
        services.close()


def test_operators_set_budgets_with_the_cli(
    stores: Stores, services: Services, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"tenant-cli-{secrets.token_hex(3)}"
    monkeypatch.setenv("LLMQ_DATABASE_URL", stores.database_url)
    assert cli(["tenants", "set", name, "--batch-token-budget", "250000"]) == 0
    assert "batch token budget 250000 tokens per model" in capsys.readouterr().out
    assert services.keys.batch_token_budget(name) == 250000
    assert cli(["tenants", "set", name, "--batch-token-budget", "default"]) == 0
    assert "no limit (LLMQ_BATCH_TOKEN_BUDGET)" in capsys.readouterr().out
    assert services.keys.batch_token_budget(name) is None
    with pytest.raises(SystemExit):
        cli(["tenants", "set", name, "--batch-token-budget", "-5"])


def test_concurrent_creates_never_overspend_the_budget(stores: Stores) -> None:
    """Twelve creates at once against a budget that fits three: exactly three batches."""
    services = build_services(make_settings(stores, db_pool_size=16))
    try:
        client_ = create_app(services=services).test_client()
        name = f"tenant-race-budget-{secrets.token_hex(3)}"
        key = services.keys.create_key(name)
        file_id = upload(client_, key, jsonl([line(1, max_tokens=100)])).get_json()["id"]
        with services.db.session() as s:
            per_file = s.scalar(text("SELECT sum(tokens) FROM file_lines WHERE file_id = :f"), {"f": file_id})
        services.keys.set_batch_token_budget(name, 3 * per_file + per_file // 2)
        principal = services.keys.authenticate(key)
        start = threading.Barrier(12)
        outcomes: list[str] = []
        payload = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}

        def make() -> None:
            start.wait()
            try:
                services.batches.create(principal, payload)
                outcomes.append("created")
            except RateLimited:
                outcomes.append("429")

        threads = [threading.Thread(target=make) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert outcomes.count("created") == 3 and outcomes.count("429") == 9
        with services.db.session() as s:
            held = s.scalar(
                text("SELECT sum(budget_tokens) FROM jobs WHERE tenant_id = :t AND status = 'queued'"),
                {"t": name},
            )
        assert held == 3 * per_file
    finally:
        services.close()


def test_the_workers_expiry_task_acts_only_while_it_holds_the_lock(
    client: FlaskClient, services: Services, tenant
) -> None:
    from app.connections import redis_client
    from worker.expiry import ExpiryTask
    from worker.leader import LeaseLock

    key = tenant[1]
    r = upload_expiring(
        client, key, {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    )
    file_id = r.get_json()["id"]
    with services.db.session() as s:
        s.execute(
            text("UPDATE files SET expires_at = now() - interval '1 second' WHERE id = :f"), {"f": file_id}
        )
    redis = redis_client(services.settings.require_redis_url())
    name = f"expiry-test-{secrets.token_hex(3)}"
    other = LeaseLock(redis, name, "other-worker", lease_seconds=10)
    mine = ExpiryTask(
        LeaseLock(redis, name, "me", lease_seconds=10), FileExpiry(services.db), interval_seconds=60
    )
    with other.hold() as held:
        assert held
        mine.tick()  # another worker holds it: nothing happens
        assert client.get(f"/v1/files/{file_id}", headers=auth(key)).status_code == 200
    mine.tick()
    assert client.get(f"/v1/files/{file_id}", headers=auth(key)).status_code == 404
