"""Fleet in a box: the project's Procfile run by honcho (a real Procfile runner) against the
machine's Postgres and Redis, as a production formation would run it.

The Procfile under test is the project's own, with one line added for a second model's
worker pool exactly as the README shows (`worker_b: env LLMQ_SERVED_MODEL_NAME=... llmq
worker`): honcho gives every process of a type the same environment, so a pool is a
process type. `release` runs first, on its own, as a release phase does; then
`web=2, worker=2, worker_b=1` run together.

Honcho ends the whole formation when any one process exits (as foreman does), so the worker
a test kills with `kill -9` is one the test started itself, beside the formation, with the
environment of the pool it joins (`join`).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import redis

from app.cli.embedded import free_port
from app.services.health import live_workers
from app.settings import Settings
from tests.helpers import ROOT, Stores, auth, fresh_database, stack_env

MODEL_A = "fleet-a"  # the Procfile's own `worker` type: two processes
MODEL_B = "fleet-b"  # the added `worker_b` type: one process
POOL_B_TYPE = "worker_b"
FORMATION = {"web": 2, "worker": 2, POOL_B_TYPE: 1}

# Honcho sends SIGKILL to whatever is still running 5 s after its SIGTERM (KILL_WAIT):
# under it the worker's own grace must be shorter, so that draining ends first.
HONCHO_KILL_WAIT_SECONDS = 5.0
SHUTDOWN_GRACE_SECONDS = 2

VENV_BIN = Path(sys.executable).parent


def pool_line(model: str) -> str:
    """The line the README documents for a second model's worker pool."""
    return f"{POOL_B_TYPE}: env LLMQ_SERVED_MODEL_NAME={model} llmq worker"


def fleet_env(stores: Stores, engine: dict[str, str]) -> dict[str, str]:
    """The one environment honcho gives every process: stores, both models declared,
    leases and presence short enough that a killed worker's lines move within seconds."""
    env = stack_env(
        stores,
        Path(MODEL_A),
        MODEL_A,
        LLMQ_MODELS=f"{MODEL_A},{MODEL_B}",
        LLMQ_SHUTDOWN_GRACE_SECONDS=str(SHUTDOWN_GRACE_SECONDS),
        LLMQ_WORKER_PRESENCE_TTL_SECONDS="3",
        LLMQ_BATCH_TICK_SECONDS="0.2",
        LLMQ_HEALTH_DETAILS="authenticated",
        **engine,
    )
    env.pop("LLMQ_MODEL")  # the simulated engine needs no model folder
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


@dataclass
class Formation:
    """A running `honcho start` and what the test needs to reach and inspect it."""

    root: Path
    env: dict[str, str]
    database_url: str
    redis_url: str
    base_port: int
    key: str = ""
    honcho: subprocess.Popen[bytes] | None = None
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)

    # --- lifecycle ----------------------------------------------------------------------

    @classmethod
    def prepare(cls, stores: Stores, root: Path, engine: dict[str, str]) -> Formation:
        base, _, db = stores.redis_url.rpartition("/")
        # A Redis database of its own: the session's workers (and their batch leader lock)
        # must not meet the fleet's.
        redis_url = f"{base}/{(int(db) + 1) % 16}"
        redis.Redis.from_url(redis_url).flushdb()
        database_url = fresh_database(stores)
        own = Stores(database_url, redis_url)
        procfile = (ROOT / "Procfile").read_text()
        assert re.search(r"^worker: llmq worker$", procfile, re.M), procfile
        (root / "Procfile").write_text(procfile.rstrip("\n") + "\n" + pool_line(MODEL_B) + "\n")
        port = _two_free_ports()
        return cls(root, fleet_env(own, engine), database_url, redis_url, port)

    def honcho_argv(self, *args: str) -> list[str]:
        # `-e /dev/null`: no developer's `.env` leaks in; the environment is the test's.
        return [str(VENV_BIN / "honcho"), "-d", str(self.root), "-e", "/dev/null", *args]

    def release(self) -> None:
        """`honcho start release`: the release phase, alone, before the formation."""
        out = subprocess.run(
            self.honcho_argv("start", "release"),
            cwd=self.root,
            env=self.env,
            capture_output=True,
            timeout=120,
            check=False,
        )
        log = out.stdout.decode(errors="replace")
        (self.root / "release.log").write_text(log)
        assert out.returncode == 0, log
        assert "database is at the latest revision" in log, log

    def create_key(self) -> None:
        out = subprocess.run(
            [str(VENV_BIN / "llmq"), "keys", "create", "--tenant", f"fleet-{secrets.token_hex(3)}"],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            timeout=60,
            check=True,
        )
        self.key = out.stdout.decode().split()[-1]

    def start(self, timeout: float = 180) -> None:
        concurrency = ",".join(f"{k}={v}" for k, v in FORMATION.items())
        log = open(self.root / "honcho.log", "wb")  # noqa: SIM115 - closed with the process
        self.honcho = subprocess.Popen(
            self.honcho_argv("start", "-p", str(self.base_port), "-c", concurrency, *FORMATION),
            cwd=self.root,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.honcho.poll() is None, f"honcho exited: {self.log()[-4000:]}"
            if self._webs_answer() and self.pool_sizes() == {MODEL_A: 2, MODEL_B: 1}:
                # Each API process reuses its read of the registry for up to its TTL (1 s):
                # one read just before the last worker joined may still stand.
                time.sleep(Settings().model_registry_ttl_seconds + 0.2)
                return
            time.sleep(0.5)
        raise TimeoutError(f"formation not up in {timeout}s: {self.pool_sizes()} {self.log()[-4000:]}")

    def join(self, model: str, timeout: float = 60) -> subprocess.Popen[bytes]:
        """A worker the test starts beside the formation (`llmq worker`, the environment of
        `model`'s pool); returns once it is consuming."""
        env = {**self.env, "LLMQ_SERVED_MODEL_NAME": model}
        log = open(self.root / f"joined-{len(self.extra)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [str(VENV_BIN / "llmq"), "worker"],
            cwd=self.root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.extra.append(proc)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, (self.root / f"joined-{len(self.extra) - 1}.log").read_text()
            if any(w["pid"] == proc.pid and w.get("consuming") for w in self.workers()):
                return proc
            time.sleep(0.2)
        raise TimeoutError(f"joined worker not consuming after {timeout}s")

    def sigterm(self) -> float:
        """SIGTERM to honcho, as a platform stops a formation; seconds until it exited."""
        assert self.honcho is not None
        start = time.monotonic()
        self.honcho.send_signal(signal.SIGTERM)
        self.honcho.wait(60)
        return time.monotonic() - start

    def cleanup(self) -> None:
        """Whatever is still running (after a failure): killed, with its children."""
        procs = [p for p in [self.honcho, *self.extra] if p is not None]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def drop_database(self) -> None:
        base, _, name = self.database_url.rpartition("/")
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    # --- what the formation runs --------------------------------------------------------

    def log(self) -> str:
        return (self.root / "honcho.log").read_text(errors="replace")

    def web_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base_port + i}" for i in range(FORMATION["web"])]

    def _webs_answer(self) -> bool:
        try:
            return all(httpx.get(f"{u}/healthz", timeout=2).status_code == 200 for u in self.web_urls())
        except httpx.HTTPError:
            return False

    def client(self, replica: int) -> httpx.Client:
        return httpx.Client(base_url=self.web_urls()[replica], headers=auth(self.key), timeout=60)

    def workers(self) -> list[dict[str, Any]]:
        """The live workers' registry entries, each with its `pid` (from its name)."""
        out = []
        for w in live_workers(redis.Redis.from_url(self.redis_url)):
            found = re.match(r"llmq-(\d+)@", str(w.get("name", "")))
            if found:
                out.append({**w, "pid": int(found.group(1))})
        return out

    def pool_sizes(self) -> dict[str, int]:
        return dict(Counter(str(w.get("model")) for w in self.workers() if w.get("consuming")))

    def pools(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for w in self.workers():
            out.setdefault(str(w.get("model")), set()).add(str(w["name"]))
        return out

    def formation_pids(self) -> dict[int, str]:
        """Every process honcho started, and their children: pid → command line."""
        assert self.honcho is not None
        out = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.honcho.pid).children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    out[child.pid] = " ".join(child.cmdline())
        return out

    # --- the database -------------------------------------------------------------------

    def query(self, sql: str, **params: Any) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.database_url) as conn:
            return list(conn.execute(sql, params).fetchall())


def _two_free_ports() -> int:
    """A base port whose successor is free too (honcho gives web.1 PORT, web.2 PORT+1)."""
    for _ in range(50):
        port = free_port(20000 + secrets.randbelow(20000))
        if free_port(port + 1) == port + 1:
            return port
    raise RuntimeError("no two free ports in a row")
