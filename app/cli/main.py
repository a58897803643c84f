"""`llmq`: run the service, manage keys and models, submit work.

Every command reads `LLMQ_*` settings; while `llmq up` runs, the others find its embedded
stores through `<data-dir>/runtime.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from app.settings import Settings

RUNTIME_FILE = "runtime.json"


def _settings(args: argparse.Namespace) -> Settings:
    """Settings, with the store URLs of a running `llmq up` filled in when unset."""
    settings = Settings()
    data_dir = Path(getattr(args, "data_dir", None) or settings.data_dir)
    runtime = data_dir / RUNTIME_FILE
    if runtime.exists() and (not settings.database_url or not settings.redis_url):
        info = json.loads(runtime.read_text())
        settings = settings.model_copy(
            update={
                "database_url": settings.database_url or info.get("database_url"),
                "redis_url": settings.redis_url or info.get("redis_url"),
            }
        )
    return settings


# --- service ----------------------------------------------------------------------------


def cmd_up(args: argparse.Namespace) -> int:
    from app.cli.stack import Stack
    from app.logs import configure_logging

    settings = Settings()
    verbose = bool(args.verbose)
    stack = Stack(
        settings,
        host=args.host,
        port=args.port,
        data_dir=Path(args.data_dir or settings.data_dir),
        verbose=verbose,
    )
    # Quiet by default: this process's own lines go to logs/llmq.log (its warnings to the
    # terminal as well), the components' to their own files; the terminal shows what a
    # person needs.
    stack.log_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(settings, log_file=None if verbose else stack.log_files()["llmq"])
    stop = threading.Event()

    def _on_signal(signum: int, _frame: Any) -> None:
        print(f"\nreceived {signal.Signals(signum).name}; shutting down...", flush=True)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    runtime = stack.data_dir / RUNTIME_FILE
    try:
        try:
            stack.start()
            runtime.write_text(json.dumps({**_runtime_info(stack), "pid": os.getpid()}))
            print("starting the worker's engine (about a minute)...", flush=True)
            ready = stack.wait_ready(args.ready_timeout)
        except RuntimeError as exc:  # a component died while starting
            _print_failure(stack, str(exc))
            return 1
        if not ready:
            if stop.is_set():
                return 0
            _print_failure(stack, "not ready in time")
            return 1
        _print_banner(stack, demo=bool(args.demo))
        if args.demo:
            from app.cli.demo import run_demo

            run_demo(stack.base_url, stack.api_key, Path(args.demo))
            return 0
        stack.supervise(stop)
        return 0
    finally:
        runtime.unlink(missing_ok=True)
        stack.stop()
        print("stopped; data kept in", stack.data_dir, flush=True)


def _print_failure(stack: Any, what: str) -> None:
    """Why `llmq up` gives up, with the end of each component's log (quiet mode hid them)."""
    print(f"llmq did not start: {what}", file=sys.stderr)
    for name in ("worker", "api"):
        tail = stack.log_tail(name)
        if tail:
            print(f"--- last lines of {stack.log_files()[name]} ---\n{tail}", file=sys.stderr)
    if not stack.verbose:
        print(f"logs: {stack.log_dir}", file=sys.stderr)


def _runtime_info(stack: Any) -> dict[str, str]:
    return {
        "database_url": stack.env["LLMQ_DATABASE_URL"],
        "redis_url": stack.env["LLMQ_REDIS_URL"],
        "base_url": stack.base_url,
    }


def _print_banner(stack: Any, *, demo: bool = False) -> None:
    model = stack.settings.model_copy(update={"model": stack.env["LLMQ_MODEL"]}).model_name
    lines = [
        "",
        "llmq is ready",
        f"  base URL : {stack.base_url}",
        f"  API key  : {stack.api_key}",
        f"  model    : {model}",
        f"  logs     : {'this terminal (--verbose)' if stack.verbose else stack.log_dir}",
    ]
    if not demo:
        lines += [
            f"  try      : curl -s {stack.base_url}/v2/jobs -H 'Authorization: Bearer {stack.api_key}' "
            "-H 'Content-Type: application/json' -d "
            f'\'{{"model": "{model}", "messages": '
            '[{"role": "user", "content": "What is the capital of France?"}]}\'',
            "  stop     : Ctrl-C",
        ]
    print("\n".join([*lines, ""]), flush=True)


def cmd_demo(args: argparse.Namespace) -> int:
    args.demo = args.file
    return cmd_up(args)


def cmd_api(args: argparse.Namespace) -> int:
    from app.serve import gunicorn_argv

    port = args.port or Settings().port
    workers = args.workers or Settings().api_workers
    argv = gunicorn_argv(
        args.host,
        port,
        workers=workers,
        connections=args.connections,
        graceful_seconds=Settings().api_graceful_seconds,
    )
    os.execv(sys.executable, argv)  # noqa: S606 - replaces this process with gunicorn


def cmd_worker(args: argparse.Namespace) -> int:
    if args.worker_command == "health":
        return cmd_worker_health(args)
    os.execv(sys.executable, [sys.executable, "-m", "worker"])  # noqa: S606


def cmd_worker_health(_args: argparse.Namespace) -> int:
    """Exit 0 iff a worker process of this host is registered and consuming (a container
    healthcheck: it runs beside the worker, in its host name and process namespace)."""
    import socket

    from redis.exceptions import RedisError

    from app.cli.worker_health import Verdict, check
    from app.connections import redis_client

    redis = redis_client(Settings().require_redis_url())
    try:
        verdict = check(redis, socket.gethostname())
    except RedisError as exc:
        verdict = Verdict(False, f"cannot read the worker registry in Redis: {type(exc).__name__}: {exc}")
    finally:
        redis.close()
    print(verdict.message, file=sys.stdout if verdict.healthy else sys.stderr)
    return 0 if verdict.healthy else 1


def cmd_migrate(args: argparse.Namespace) -> int:
    """The release step: upgrade the schema, then register `LLMQ_BOOTSTRAP_API_KEY` (when set)
    for the default tenant. Both are idempotent, so it runs on every deploy."""
    from app.cli.stack import run_migrations

    settings = _settings(args)
    run_migrations(settings.require_database_url())
    print("database is at the latest revision")
    if settings.bootstrap_api_key:
        from app.connections import ADMIN_POOL
        from app.db import Database
        from app.services.keys import KeyService

        db = Database.from_settings(settings, ADMIN_POOL)
        try:
            keys = KeyService(db)
            keys.create_key(settings.default_tenant, name="bootstrap", key=settings.bootstrap_api_key)
        finally:
            db.dispose()
        print(f"LLMQ_BOOTSTRAP_API_KEY is registered for tenant {settings.default_tenant!r}")
    return 0


# --- batches ------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> Any:
    """URL and key from the flags, the environment, or a running `llmq up`'s data dir."""
    from app.cli.client import LlmqClient

    settings = Settings()
    data_dir = Path(getattr(args, "data_dir", None) or settings.data_dir)
    url = args.url or settings.url
    key = args.key or settings.api_key or settings.bootstrap_api_key
    runtime = data_dir / RUNTIME_FILE
    if not url and runtime.exists():
        url = json.loads(runtime.read_text()).get("base_url")
    if not key and (data_dir / "api_key").exists():
        key = (data_dir / "api_key").read_text().strip()
    if not url or not key:
        raise RuntimeError(
            "no service to talk to: pass --url and --key (or LLMQ_URL, LLMQ_API_KEY), or run `llmq up`"
        )
    return LlmqClient(url, key)


def cmd_batch_submit(args: argparse.Namespace) -> int:
    from app.cli.batch import submit

    batch = submit(_client(args), Path(args.file), window=args.window, wait=args.wait)
    return 0 if batch["status"] in ("completed", "in_progress", "validating") else 1


def cmd_batch_status(args: argparse.Namespace) -> int:
    batch = _client(args).get_batch(args.batch_id)
    print(json.dumps(batch, indent=2))
    return 0


def cmd_batch_cancel(args: argparse.Namespace) -> int:
    batch = _client(args).cancel_batch(args.batch_id)
    print(f"batch {batch['id']}: {batch['status']}")
    return 0


def cmd_batch_download(args: argparse.Namespace) -> int:
    from app.cli.batch import download

    client = _client(args)
    batch = client.get_batch(args.batch_id)
    if not (batch.get("output_file_id") or batch.get("error_file_id")):
        print(f"batch {batch['id']} is {batch['status']}: no output or error file yet")
        return 1
    out = Path(args.output_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        why = "it is a file, not a directory" if out.is_file() else (exc.strerror or str(exc))
        print(f"cannot write to {out}: {why}", file=sys.stderr)
        return 1
    download(client, batch, out / batch["id"])
    return 0


def cmd_batch_tail(args: argparse.Namespace) -> int:
    from app.cli.batch import tail

    batch = tail(_client(args), args.batch_id, after=args.after)
    return 0 if batch is not None else 1


# --- webhooks ---------------------------------------------------------------------------


def cmd_webhooks_create(args: argparse.Namespace) -> int:
    from app.cli.webhooks import create

    create(_client(args), args.url, args.event, args.name)
    return 0


def cmd_webhooks_list(args: argparse.Namespace) -> int:
    from app.cli.webhooks import list_endpoints

    list_endpoints(_client(args))
    return 0


def cmd_webhooks_delete(args: argparse.Namespace) -> int:
    _client(args).webhooks("DELETE", f"/{args.endpoint_id}")
    print(f"webhook endpoint {args.endpoint_id} deleted")
    return 0


def cmd_webhooks_rotate(args: argparse.Namespace) -> int:
    from app.cli.webhooks import rotate

    rotate(_client(args), args.endpoint_id, keep_old=args.keep_old)
    return 0


def cmd_webhooks_deliveries(args: argparse.Namespace) -> int:
    from app.cli.webhooks import deliveries

    deliveries(_client(args), args.endpoint_id, status=args.status, limit=args.limit)
    return 0


# --- keys -------------------------------------------------------------------------------


def _keys(args: argparse.Namespace) -> Any:
    """Revoking a key or changing a band also tells the API's key caches, through Redis
    when one is configured (app/services/keys.py)."""
    from app.connections import ADMIN_POOL, redis_client
    from app.db import Database
    from app.services.keys import KeyService

    settings = _settings(args)
    redis = redis_client(settings.redis_url) if settings.redis_url else None
    return KeyService(Database.from_settings(settings, ADMIN_POOL), redis=redis)


def cmd_keys_create(args: argparse.Namespace) -> int:
    print(_keys(args).create_key(args.tenant, name=args.name))
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    rows = _keys(args).list_keys(args.tenant)
    print(f"{'ID':<34} {'TENANT':<16} {'PREFIX':<14} {'NAME':<16} {'CREATED':<20} REVOKED")
    for k in rows:
        revoked = k.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if k.revoked_at else "-"
        print(
            f"{k.id:<34} {k.tenant:<16} {k.prefix + '…':<14} {(k.name or '-'):<16} "
            f"{k.created_at.strftime('%Y-%m-%d %H:%M:%S'):<20} {revoked}"
        )
    return 0


def _unannounced(args: argparse.Namespace) -> None:
    """Without Redis the API's key caches are not told of a change: say when it takes effect."""
    settings = _settings(args)
    if not settings.redis_url and settings.auth_cache_seconds > 0:
        print(
            "note: LLMQ_REDIS_URL is not set, so the API's key caches were not told; "
            f"API processes apply this within {settings.auth_cache_seconds:g} s (LLMQ_AUTH_CACHE_SECONDS)",
            file=sys.stderr,
        )


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    _keys(args).revoke(args.key_id)
    print(f"revoked {args.key_id}")
    _unannounced(args)
    return 0


def cmd_tenants_set(args: argparse.Namespace) -> int:
    keys = _keys(args)
    touched = (args.priority_min, args.priority_max, args.weight, args.batch_token_budget)
    if any(v is not None for v in touched):
        keys.ensure_tenant(args.tenant)
    if args.priority_min is None and args.priority_max is None:
        band = keys.priority_band(args.tenant)
    else:
        band = keys.set_priority_band(args.tenant, args.priority_min, args.priority_max)
        _unannounced(args)
    if args.weight is not None:
        keys.set_share_weight(args.tenant, args.weight)
    asked = args.batch_token_budget
    if asked is not None:
        keys.set_batch_token_budget(args.tenant, None if asked == "default" else int(asked))
    own = keys.batch_token_budget(args.tenant)
    tokens = own if own is not None else _settings(args).batch_token_budget
    budget = f"{tokens} tokens per model" if tokens else "no limit"
    source = "" if own is not None else " (LLMQ_BATCH_TOKEN_BUDGET)"
    print(
        f"tenant {args.tenant}: priority {band.low}..{band.high} (lower runs earlier; "
        f"default {band.default}); fair-share weight {keys.share_weight(args.tenant):g}; "
        f"batch token budget {budget}{source}"
    )
    return 0


def _budget_arg(value: str) -> str:
    if value == "default" or (value.isdigit() and int(value) >= 0):
        return value
    raise argparse.ArgumentTypeError("a number of tokens (0: no limit) or `default`")


# --- models -----------------------------------------------------------------------------


def cmd_model_build_tiny(args: argparse.Namespace) -> int:
    from app.modelkit.tiny import build_tiny

    out = build_tiny(Path(args.dir))
    print(f"tiny model written to {out}")
    return 0


def cmd_model_prepare(args: argparse.Namespace) -> int:
    from app.modelkit.smollm2 import prepare_smollm2

    if args.name != "smollm2":
        print(f"unknown model {args.name!r}; known: smollm2", file=sys.stderr)
        return 2
    out = prepare_smollm2(Path(args.dir))
    print(f"SmolLM2-135M-Instruct written to {out}")
    return 0


# --- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmq",
        description="Queue-based batch inference: chat completion jobs through Postgres, Redis, "
        "Celery and vLLM.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def service_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", default="127.0.0.1", help="address the API binds")
        sp.add_argument("--port", type=int, default=8000, help="port the API binds")
        sp.add_argument(
            "--data-dir", default=None, help="embedded stores, model and key live here (LLMQ_DATA_DIR)"
        )
        sp.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for readiness")
        sp.add_argument(
            "--verbose",
            action="store_true",
            help="show every component's logs here (the API's, the worker's with Celery's and vLLM's, "
            "the embedded Postgres's and Redis's, llmq's) instead of in files under the data dir",
        )

    up = sub.add_parser(
        "up",
        help="run everything in the foreground (embedded Postgres/Redis when no URLs are set)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    service_args(up)
    up.add_argument("--demo", metavar="FILE", default=None, help="run a sample file through it, then stop")
    up.set_defaults(func=cmd_up)

    demo = sub.add_parser(
        "demo",
        help="start everything, push the sample requests through, print answers and stats, stop",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    service_args(demo)
    demo.add_argument("--file", default="examples/sample.jsonl", help="JSONL of chat requests")
    demo.set_defaults(func=cmd_demo)

    api = sub.add_parser("api", help="serve the HTTP API with gunicorn (production)")
    api.add_argument("--host", default="0.0.0.0")
    api.add_argument("--port", type=int, default=None, help="PORT or LLMQ_PORT; 8000 without either")
    api.add_argument("--workers", type=int, default=None, help="gunicorn processes; LLMQ_API_WORKERS")
    api.add_argument("--connections", type=int, default=2000, help="concurrent connections per worker")
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run one worker (one engine) for LLMQ_MODEL")
    worker_sub = worker.add_subparsers(dest="worker_command", required=False, metavar="ACTION")
    worker_sub.add_parser(
        "health",
        help="exit 0 iff a worker process of this host is registered and consuming (a container healthcheck)",
    )
    worker.set_defaults(func=cmd_worker, worker_command=None)

    migrate = sub.add_parser(
        "migrate",
        help="upgrade the database to the latest schema and register LLMQ_BOOTSTRAP_API_KEY (the "
        "release step; idempotent)",
    )
    migrate.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")
    migrate.set_defaults(func=cmd_migrate)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kc = keys_sub.add_parser("create", help="print a new key for a tenant (created if new)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--name", default=None, help="a label for the key")
    kc.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")
    kc.set_defaults(func=cmd_keys_create)
    kl = keys_sub.add_parser("list", help="list keys (prefixes only; keys are stored hashed)")
    kl.add_argument("--tenant", default=None)
    kl.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")
    kl.set_defaults(func=cmd_keys_list)
    kr = keys_sub.add_parser("revoke", help="revoke a key by its id")
    kr.add_argument("key_id")
    kr.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")
    kr.set_defaults(func=cmd_keys_revoke)

    tenants = sub.add_parser("tenants", help="set what a tenant may ask for")
    tenants_sub = tenants.add_subparsers(dest="tenants_command", required=True, metavar="ACTION")
    ts = tenants_sub.add_parser(
        "set",
        help="set the band of `priority` values a tenant's requests may use, its fair-share "
        "weight and its batch token budget (created if new); with no flags, print them",
    )
    ts.add_argument("tenant")
    ts.add_argument(
        "--priority-min", type=int, default=None, help="most favourable priority allowed (lower runs earlier)"
    )
    ts.add_argument("--priority-max", type=int, default=None, help="least favourable priority allowed")
    ts.add_argument(
        "--weight",
        type=float,
        default=None,
        help="the tenant's weight in the fair share of batch dispatch (default 1; 2 = twice the lines)",
    )
    ts.add_argument(
        "--batch-token-budget",
        type=_budget_arg,
        default=None,
        metavar="TOKENS",
        help="tokens the tenant may have enqueued per model in unfinished batches (0: no limit; "
        "`default`: follow LLMQ_BATCH_TOKEN_BUDGET)",
    )
    ts.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")
    ts.set_defaults(func=cmd_tenants_set)

    batch = sub.add_parser("batch", help="submit JSONL batches and follow them (OpenAI Batch API)")
    batch_sub = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")

    def client_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--url", default=None, help="llmq base URL (default: LLMQ_URL or the running `llmq up`)"
        )
        sp.add_argument(
            "--key", default=None, help="API key (default: LLMQ_API_KEY or the running `llmq up`)"
        )
        sp.add_argument("--data-dir", default=None, help="LLMQ_DATA_DIR by default")

    bs = batch_sub.add_parser(
        "submit",
        help="upload FILE.jsonl, create a batch; with --wait follow it and write FILE.output/errors.jsonl",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bs.add_argument("file")
    bs.add_argument("--wait", action="store_true", help="follow with a progress bar and download the results")
    bs.add_argument("--window", default="24h", help="completion window (e.g. 24h, 30m)")
    client_args(bs)
    bs.set_defaults(func=cmd_batch_submit)
    for name, func, text in (
        ("status", cmd_batch_status, "print a batch object"),
        ("cancel", cmd_batch_cancel, "cancel a batch (finished lines are kept)"),
        ("download", cmd_batch_download, "write a batch's output and error files"),
    ):
        bp = batch_sub.add_parser(name, help=text)
        bp.add_argument("batch_id")
        if name == "download":
            bp.add_argument(
                "--output-dir",
                default=".",
                help="where BATCH_ID.output.jsonl and .errors.jsonl go (made if missing)",
            )
        client_args(bp)
        bp.set_defaults(func=func)
    bt_ = batch_sub.add_parser(
        "tail", help="print a batch's lines as they end (JSONL on stdout) until the batch ends"
    )
    bt_.add_argument("batch_id")
    bt_.add_argument("--after", default=None, help="a cursor printed by an earlier tail: skip up to it")
    client_args(bt_)
    bt_.set_defaults(func=cmd_batch_tail)

    hooks = sub.add_parser("webhooks", help="signed webhooks when batches and jobs end")
    hooks_sub = hooks.add_subparsers(dest="webhooks_command", required=True, metavar="ACTION")
    wc = hooks_sub.add_parser("create", help="add an endpoint; prints its signing secret once")
    wc.add_argument("url")
    wc.add_argument(
        "--event",
        action="append",
        default=None,
        help="an event type to send (repeatable; default: all): batch.completed, batch.failed, "
        "batch.expired, batch.cancelled, job.succeeded, job.failed, job.cancelled",
    )
    wc.add_argument("--name", default="", help="a label for the endpoint")
    client_args(wc)
    wc.set_defaults(func=cmd_webhooks_create)
    wl = hooks_sub.add_parser("list", help="list endpoints (secrets as hints only)")
    client_args(wl)
    wl.set_defaults(func=cmd_webhooks_list)
    for name, func, text in (
        ("delete", cmd_webhooks_delete, "delete an endpoint and its pending deliveries"),
        ("rotate", cmd_webhooks_rotate, "a new signing secret, printed once"),
        ("deliveries", cmd_webhooks_deliveries, "an endpoint's events: status, attempts, last error"),
    ):
        wp = hooks_sub.add_parser(name, help=text)
        wp.add_argument("endpoint_id")
        if name == "rotate":
            wp.add_argument("--keep-old", action="store_true", help="the old secret signs too for 24 hours")
        if name == "deliveries":
            wp.add_argument("--status", choices=["pending", "delivered", "failed"], default=None)
            wp.add_argument("--limit", type=int, default=20)
        client_args(wp)
        wp.set_defaults(func=func)

    model = sub.add_parser("model", help="build or prepare model folders")
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    bt = model_sub.add_parser("build-tiny", help="a tiny random Llama for tests (seconds, offline)")
    bt.add_argument("dir")
    bt.set_defaults(func=cmd_model_build_tiny)
    mp = model_sub.add_parser("prepare", help="turn a bundled model into a folder vLLM loads")
    mp.add_argument("name", choices=["smollm2"])
    mp.add_argument("dir")
    mp.set_defaults(func=cmd_model_prepare)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`llmq batch tail B | head -3`): stop quietly, as a shell
        # tool does on SIGPIPE. Python would report the pipe again when it flushes stdout
        # at exit, so stdout points at /dev/null from here on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as exc:
        from app.errors import LlmqError

        if isinstance(exc, LlmqError | RuntimeError | ValueError):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
