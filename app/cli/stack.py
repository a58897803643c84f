"""The single-machine deployment behind `llmq up` and `llmq demo`: embedded stores (when no
URLs are configured), the model, migrations, one worker and the API, supervised."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from app.cli.embedded import Server, die_with_parent, free_port, pg_start, redis_start
from app.serve import gunicorn_argv
from app.settings import Settings

log = logging.getLogger("llmq.up")

DEFAULT_MODEL_DIR = "models/SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_migrations(database_url: str) -> None:
    """`alembic upgrade head` against `database_url`."""
    from alembic import command
    from alembic.config import Config

    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.attributes["url"] = database_url
    cfg.attributes["configure_logger"] = False
    command.upgrade(cfg, "head")


class Backoff:
    """The restart delay of one supervised child: `first`, doubling with each exit up to
    `cap`, and back to `first` once the child has stayed up `healthy` seconds (a crash a
    day must not inherit the delay of a crash loop last week)."""

    def __init__(
        self,
        first: float = 1.0,
        cap: float = 30.0,
        healthy: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first = first
        self._cap = cap
        self._healthy = healthy
        self._clock = clock
        self._delay = first
        self._started = clock()

    def started(self) -> None:
        self._started = self._clock()

    def exited(self) -> float:
        """The child exited: how long to wait before starting it again."""
        if self._clock() - self._started >= self._healthy:
            self._delay = self._first
        delay = self._delay
        self._delay = min(delay * 2, self._cap)
        return delay


class Stack:
    def __init__(
        self,
        settings: Settings,
        *,
        host: str,
        port: int,
        data_dir: Path,
        child_env: dict[str, str] | None = None,
        verbose: bool = False,
    ) -> None:
        self.settings = settings
        # Quiet by default: each component writes to its own file under `log_dir` (the
        # embedded Postgres and Redis in their own data folders); `verbose` leaves every
        # component's output on this terminal instead.
        self.verbose = verbose
        self._extra_env = dict(child_env or {})
        self.host = host
        self.port = port
        self.data_dir = data_dir.resolve()
        self.log_dir = self.data_dir / "logs"
        self.servers: list[Server] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env: dict[str, str] = {}
        self.api_key = ""
        self._stopping = threading.Event()
        self._backoff = {"worker": Backoff(), "api": Backoff()}

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    # --- pieces ----------------------------------------------------------------------

    def start_stores(self) -> None:
        database_url = self.settings.database_url
        if not database_url:
            port = free_port(self.settings.embedded_pg_port)
            pg = pg_start(
                self.data_dir / "postgres",
                port,
                "llmq",
                os_user=self.settings.embedded_pg_os_user,
                terminal=self.verbose,
            )
            self.servers.append(pg)
            database_url = pg.url
            log.info("embedded postgres up", extra={"url": pg.url})
        redis_url = self.settings.redis_url
        if not redis_url:
            port = free_port(self.settings.embedded_redis_port)
            rd = redis_start(self.data_dir / "redis", port, terminal=self.verbose)
            self.servers.append(rd)
            redis_url = rd.url
            log.info("embedded redis up", extra={"url": rd.url})
        self.env["LLMQ_DATABASE_URL"] = database_url
        self.env["LLMQ_REDIS_URL"] = redis_url

    def ensure_model(self) -> None:
        model = self.settings.model
        if not model:
            target = self.data_dir / DEFAULT_MODEL_DIR
            if not (target / "config.json").exists():
                from app.modelkit.smollm2 import prepare_smollm2

                print(
                    f"Preparing SmolLM2-135M-Instruct into {target} (first start only, ~1 min)...", flush=True
                )
                prepare_smollm2(target)
            model = str(target)
        self.env["LLMQ_MODEL"] = model

    def migrate(self) -> None:
        run_migrations(self.env["LLMQ_DATABASE_URL"])

    def ensure_key(self) -> None:
        from app.connections import ADMIN_POOL
        from app.db import Database
        from app.services.keys import KeyService

        pooler = self.settings.database_pooler != "none"
        db = Database.from_url(self.env["LLMQ_DATABASE_URL"], ADMIN_POOL, transaction_pooler=pooler)
        try:
            keys = KeyService(db)
            key_file = self.data_dir / "api_key"
            key = self.settings.bootstrap_api_key
            if not key and key_file.exists():
                key = key_file.read_text().strip()
            key = keys.create_key(self.settings.default_tenant, name="bootstrap", key=key or None)
            if not self.settings.bootstrap_api_key:
                key_file.write_text(key + "\n")
                key_file.chmod(0o600)
            self.api_key = key
        finally:
            db.dispose()

    def _child_env(self) -> dict[str, str]:
        return {**os.environ, **self._extra_env, **self.env, "PYTHONUNBUFFERED": "1"}

    # Like the stores, the worker and the API die with `llmq up`, even by `kill -9`, so
    # nothing is left holding the port or the engine. The worker is killed outright: its
    # stores go down with it, so a drain could save nothing, and its engine processes die
    # with it in turn; its jobs are handed on when a worker runs again. The API (gunicorn)
    # gets SIGINT, its quick shutdown, instead of waiting out open streams.

    def log_files(self) -> dict[str, Path]:
        """Where each component writes (`llmq up` itself: `llmq`)."""
        files = {name: self.log_dir / f"{name}.log" for name in ("llmq", "api", "worker")}
        for server in self.servers:
            if server.log_path is not None:
                files[server.name] = server.log_path
        return files

    def _start(self, name: str, argv: list[str], death_signal: int) -> None:
        out = None if self.verbose else open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        try:
            self.procs[name] = subprocess.Popen(
                argv,
                env=self._child_env(),
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=True,
                preexec_fn=die_with_parent(death_signal),  # noqa: PLW1509 - prctl only, no locks
            )
        finally:
            if out is not None:
                out.close()  # the child has its own copy
        self._backoff[name].started()

    def start_worker(self) -> None:
        self._start("worker", [sys.executable, "-m", "worker"], signal.SIGKILL)

    def start_api(self) -> None:
        self._start(
            "api",
            gunicorn_argv(
                self.host,
                self.port,
                workers=self.settings.api_workers,
                graceful_seconds=self.settings.api_graceful_seconds,
            ),
            signal.SIGINT,
        )

    def log_tail(self, name: str, lines: int = 20) -> str:
        """The end of a component's log file, for a person told that it failed."""
        path = self.log_dir / f"{name}.log"
        if self.verbose or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - 64 * 1024))
            tail = f.read().decode(errors="replace").splitlines()[-lines:]
        return "\n".join(tail)

    def wait_ready(self, timeout: float) -> bool:
        """Poll /readyz until the API, stores and a consuming worker all answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stopping.is_set():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        return False

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        self.start_stores()
        self.ensure_model()
        self.migrate()
        self.ensure_key()
        self.start_worker()
        self.start_api()

    def supervise(self, stop: threading.Event) -> None:
        """Restart a worker or API process that dies (an engine crash exits the worker
        on purpose), each after its own growing delay, until `stop` is set. Runs on the
        thread that started the children: their parent-death signal is tied to it."""
        restart_at: dict[str, float] = {}
        while not stop.wait(0.5):
            for name, proc in list(self.procs.items()):
                if proc.poll() is None:
                    continue
                if name not in restart_at:
                    delay = self._backoff[name].exited()
                    where = "" if self.verbose else f" (its log: {self.log_files()[name]})"
                    print(
                        f"{name} exited with {proc.returncode}; restarting in {delay:.0f}s{where}", flush=True
                    )
                    restart_at[name] = time.monotonic() + delay
                elif time.monotonic() >= restart_at[name]:
                    del restart_at[name]
                    (self.start_worker if name == "worker" else self.start_api)()

    def stop(self) -> None:
        """API first (no new work), then the worker (drains), then the stores."""
        self._stopping.set()
        for name in ("api", "worker"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=self.settings.shutdown_grace_seconds + 40)
                except subprocess.TimeoutExpired:
                    print(f"{name} did not stop in time; killing", flush=True)
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for server in reversed(self.servers):
            server.stop()
