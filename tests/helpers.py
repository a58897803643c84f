"""Helpers shared by test modules: settings and auth for the session's stores, the real
processes (worker, API under gunicorn) the integration and fault tiers start, waiting on
jobs and batches, SSE parsing, and the request builders several modules use. Fixtures stay
in the conftest files; everything importable lives here."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import psycopg
import redis
from flask.testing import FlaskClient
from openai.types import Batch as SdkBatch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app import tracing
from app.cli.embedded import free_port
from app.db import Database
from app.schemas.chat import ChatCompletionV2Request
from app.schemas.completion import ChatCompletion, TextCompletion
from app.schemas.jobs import JobObject
from app.serve import gunicorn_argv
from app.services.health import live_workers
from app.settings import Settings
from tests.pgbouncer import VIA_PGBOUNCER

ROOT = Path(__file__).resolve().parents[1]


PG_URL = os.environ.get("LLMQ_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


REDIS_URL = os.environ.get("LLMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379")


REDIS_DB = int(os.environ.get("LLMQ_TEST_REDIS_DB", "13"))


@dataclass
class Stores:
    """Where the tests' processes find Postgres and Redis. Under LLMQ_TEST_VIA_PGBOUNCER=1,
    `database_url` is a PgBouncer in transaction mode (`pooler` "pgbouncer", passed on to
    every Settings and process environment built from these stores) and `direct_url` the
    same database on Postgres itself, for admin steps (creating databases, migrations)."""

    database_url: str
    redis_url: str
    direct_url: str | None = None
    pooler: str = field(default_factory=lambda: "pgbouncer" if VIA_PGBOUNCER else "none")

    @property
    def admin_url(self) -> str:
        return self.direct_url or self.database_url


@contextlib.contextmanager
def tracing_on() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the block (database engines created inside it are instrumented, as in a
    traced process); the exporter it yields keeps the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.setup(Settings(otel=True), service="llmq-test", provider=provider) is provider
    try:
        yield exporter
    finally:
        tracing.teardown()
        provider.shutdown()


def statements_of(exporter: InMemorySpanExporter) -> list[str]:
    return [str(span.attributes.get("db.statement", "")) for span in exporter.get_finished_spans()]


def back_in_the_pool_as_lent(db: Database) -> None:
    """The pool's next connection is out of autocommit and in no transaction."""
    fairy = db.engine.raw_connection()
    try:
        assert fairy.driver_connection.autocommit is False
        assert fairy.driver_connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    finally:
        fairy.close()


def cut_pooled_connections(db: Database, n: int) -> None:
    """Open `n` pooled connections and cut their sockets, as a Postgres restart or a network
    cut leaves them, and put them back in the pool."""
    held = [db.engine.raw_connection() for _ in range(n)]
    for pooled in held:
        raw = pooled.driver_connection
        assert isinstance(raw, psycopg.Connection)
        raw.execute("SELECT 1")
        raw.rollback()
        with socket.fromfd(raw.fileno(), socket.AF_INET, socket.SOCK_STREAM) as borrowed:
            borrowed.shutdown(socket.SHUT_RDWR)
    for pooled in held:
        pooled.close()


def fresh_database(stores: Stores) -> str:
    """A new, migrated database beside the session's, for a test whose workers must not meet
    the session's (their sweepers would judge each other's jobs by a Redis they do not share).
    Made and migrated on Postgres directly; the URL returned is reached the way the session's
    is (through its PgBouncer, whose `*` entry passes any database name)."""
    import secrets

    import psycopg

    from app.cli.stack import run_migrations

    base, _, _ = stores.admin_url.rpartition("/")
    name = f"llmq_test_{secrets.token_hex(4)}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    run_migrations(f"{base}/{name}")
    return f"{stores.database_url.rpartition('/')[0]}/{name}"


def make_settings(stores: Stores, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "database_url": stores.database_url,
        "database_pooler": stores.pooler,
        "redis_url": stores.redis_url,
        # No worker serves this name, so API tests' jobs stay queued.
        "model": "api-only",
        "served_model_name": "api-only",
        "cancel_wait_seconds": 2.0,
        "max_model_len": 2048,
        # Many tests send wrong keys from one address; the limit has its own tests.
        "auth_failures_per_minute": 0,
    }
    base.update(overrides)
    return Settings(**base)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


TINY_DIR = ROOT / ".test-models" / "tiny"


E2E_MODEL = "tiny"


def stack_env(stores: Stores, model: Path, served_name: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQ_")}
    env.update(
        {
            "LLMQ_DATABASE_URL": stores.database_url,
            "LLMQ_DATABASE_POOLER": stores.pooler,
            "LLMQ_REDIS_URL": stores.redis_url,
            "LLMQ_MODEL": str(model),
            "LLMQ_SERVED_MODEL_NAME": served_name,
            "LLMQ_MAX_NUM_SEQS": "32",
            "LLMQ_KV_CACHE_SPACE_GIB": "1",
            "LLMQ_LEASE_SECONDS": "6",
            "LLMQ_SWEEPER_INTERVAL_SECONDS": "1",
            "LLMQ_REQUEUE_GRACE_SECONDS": "5",
            "LLMQ_WORKER_HEARTBEAT_SECONDS": "1",
            "LLMQ_SHUTDOWN_GRACE_SECONDS": "3",
            # Tests poll hard; the limiter has its own tests (tests/api/test_limits.py).
            "LLMQ_RATE_LIMIT_PER_MINUTE": "0",
            "PYTHONUNBUFFERED": "1",
            **extra,
        }
    )
    return env


class WorkerProcess:
    """`python -m worker` as a child; ready once it shows in the registry as consuming."""

    def __init__(self, env: dict[str, str], log_path: Path, *, module: str = "worker") -> None:
        self.env = env
        self.log_path = log_path
        self.module = module  # a test may run the worker through a launcher of its own
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 240) -> WorkerProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env=self.env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        r = redis.Redis.from_url(self.env["LLMQ_REDIS_URL"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log_path}")
            names = [
                w.get("name", "")
                for w in live_workers(r)
                if w.get("model") == self.env["LLMQ_SERVED_MODEL_NAME"]
            ]
            if any(n.startswith(f"llmq-{self.proc.pid}@") for n in names):
                return self
            time.sleep(0.5)
        raise TimeoutError(f"worker not consuming after {timeout}s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker and its engine processes (its whole session)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class ApiProcess:
    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.port = free_port(18500)
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(log_path, "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            gunicorn_argv("127.0.0.1", self.port),
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"API did not start; see {log_path}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)

    def warnings(self, last: int = 20) -> list[str]:
        """The log's last WARNING and ERROR lines: what a failed assertion shows (CI keeps
        no logs)."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        marks = (" WARNING ", " ERROR ", "[WARNING]", "[ERROR]", "[CRITICAL]")
        return [x for x in lines if any(m in x for m in marks)][-last:]


@dataclass
class Stack:
    url: str
    key: str
    model: str
    worker: WorkerProcess
    env: dict[str, str]

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60)


def wait_for(client: httpx.Client, job_ids: list[str], timeout: float = 120) -> dict[str, dict]:
    """Poll until every job is terminal; returns the job objects by id."""
    done: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(job_ids):
        if time.monotonic() > deadline:
            pending = {j: client.get(f"/v2/jobs/{j}").json()["status"] for j in job_ids if j not in done}
            raise TimeoutError(f"jobs not finished: {pending}")
        for job_id in job_ids:
            if job_id not in done:
                job = client.get(f"/v2/jobs/{job_id}").json()
                if job["status"] in ("succeeded", "failed", "cancelled", "expired"):
                    # Every job the suite sees is held to the seed shapes.
                    JobObject.model_validate(job)
                    if job["response"] is not None:
                        text = job["response"].get("object") == "text_completion"
                        (TextCompletion if text else ChatCompletion).model_validate(job["response"])
                    done[job_id] = job
        time.sleep(0.2)
    return done


def submit_unchecked(services, stack: Stack, body: dict) -> str:  # type: ignore[no-untyped-def]
    """Queue a job past the API's checks (as a batch line is), so the worker's own checks
    are what meets it."""
    from app.schemas.chat import ChatCompletionV2Request

    principal = services.keys.authenticate(stack.key)
    return str(services.jobs.submit_request(principal, ChatCompletionV2Request.model_validate(body)).id)


@dataclass
class Event:
    id: str | None
    data: str

    @property
    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def done(self) -> bool:
        return self.data == "[DONE]"


def events(response: httpx.Response) -> Iterator[Event]:
    event_id: str | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line == "":
            if data:
                yield Event(event_id, "\n".join(data))
            event_id, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def read_all(client: httpx.Client, path: str, headers: dict[str, str] | None = None) -> list[Event]:
    with client.stream("GET", path, headers=headers or {}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(events(r))


def text_of(evts: list[Event], index: int = 0) -> str:
    out = []
    for e in evts:
        if e.done or "error" in e.json:
            continue
        for choice in e.json["choices"]:
            if choice["index"] == index:
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


def gone_within(pids: dict[int, str], timeout: float) -> dict[int, str]:
    """Those of `pids` still alive (zombies count as gone) after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {}
        for pid, name in pids.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive[pid] = name
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "api-only",
            "messages": [{"role": "user", "content": f"hi {i}"}],
            "max_tokens": 5,
            **body,
        },
    }


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (json.dumps(x) if not isinstance(x, bytes) else x.decode("latin-1")).encode() + b"\n" for x in lines
    )


def upload(client: FlaskClient, key: str, data: bytes, purpose: str = "batch"):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/files",
        data={"purpose": purpose, "file": (io.BytesIO(data), "input.jsonl")},
        headers=auth(key),
        content_type="multipart/form-data",
    )


def create(client: FlaskClient, key: str, file_id: str, **extra: Any):  # type: ignore[no-untyped-def]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **extra}
    return client.post("/v1/batches", json=body, headers=auth(key))


def queued(services, n: int) -> list[str]:  # type: ignore[no-untyped-def]
    principal = services.keys.authenticate(services.keys.create_key("tenant-store"))
    req = ChatCompletionV2Request.model_validate(
        {"model": "api-only", "messages": [{"role": "user", "content": "x"}]}
    )
    return [services.jobs.submit_request(principal, req).id for _ in range(n)]


def response(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


TERMINAL = {"completed", "failed", "expired", "cancelled"}


def lines(model: str, n: int, *, max_tokens: int = 4, poison: set[int] = frozenset(), **body: Any) -> bytes:  # type: ignore[assignment]
    out = []
    for i in range(n):
        content = "word " * 3000 if i in poison else f"Request number {i}."
        out.append(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": max_tokens,
                    **body,
                },
            }
        )
    return "".join(json.dumps(x) + "\n" for x in out).encode()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.key, max_retries=0)


def wait_batch(
    client: openai.OpenAI, batch_id: str, timeout: float = 300, until: set[str] = TERMINAL
) -> SdkBatch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)


def body(stack: Stack, **fields: Any) -> dict[str, Any]:
    return {"model": stack.model, "messages": [{"role": "user", "content": "Tell me something."}], **fields}


def run_many(stack: Stack, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    with stack.client() as c, ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda b: c.post("/v2/jobs", json=b).json()["id"], bodies))
        done = wait_for(c, ids, timeout=300)
    return [done[i] for i in ids]


def run(stack: Stack, **fields: Any) -> dict[str, Any]:
    return run_many(stack, [body(stack, **fields)])[0]


def pick_stop(full: str) -> str:
    """A 3-character piece of `full` that first occurs after its start: stopping on it cuts
    the text exactly there."""
    for start in range(5, len(full) - 3):
        piece = full[start : start + 3]
        if piece.strip() and full.find(piece) == start and "\ufffd" not in piece:
            return piece
    raise AssertionError(f"no stop string in {full!r}")


def next_message(pubsub: redis.client.PubSub, timeout: float) -> dict[str, Any] | None:
    """The next pub/sub message within `timeout` (a read that meets only a skipped subscribe
    confirmation returns None at once, so one read is not enough)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        message = pubsub.get_message(timeout=left)
        if message is not None:
            return message  # type: ignore[no-any-return]
    return None


def subscribers(r: redis.Redis, channel: str) -> int:
    """How many clients are subscribed to `channel` now (`PUBSUB NUMSUB`)."""
    return int(r.pubsub_numsub(channel)[0][1])


def wait_subscribers(r: redis.Redis, channel: str, n: int, timeout: float = 5) -> None:
    """Wait until `channel` has exactly `n` subscribers; fail the test after `timeout`."""
    deadline = time.monotonic() + timeout
    while (count := subscribers(r, channel)) != n:
        assert time.monotonic() < deadline, f"{channel} has {count} subscribers, not {n}"
        time.sleep(0.005)
