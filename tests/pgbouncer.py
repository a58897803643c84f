"""PgBouncer in transaction pooling mode in front of a test Postgres: Debian's `pgbouncer`
(installed by scripts/test-deps.sh), its own configuration in a temporary folder, a free
port, every database name passed through (`*`), clients trusted as the Postgres user.

LLMQ_TEST_VIA_PGBOUNCER=1 puts every API, worker and service the integration and fault
tiers start behind one (tests/conftest.py, tests/faults/conftest.py); migrations and
database creation stay on direct Postgres. tests/api/test_pgbouncer.py starts its own
with two server connections."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg

from app.cli.embedded import free_port

VIA_PGBOUNCER = os.environ.get("LLMQ_TEST_VIA_PGBOUNCER", "") == "1"

# Debian installs it under /usr/sbin, which a non-root PATH may lack.
_CANDIDATES = ("pgbouncer", "/usr/sbin/pgbouncer")


def pgbouncer_bin() -> str:
    """The pgbouncer executable.

    Raises:
        RuntimeError: not installed (scripts/test-deps.sh installs it).
    """
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("pgbouncer is not installed: run scripts/test-deps.sh (apt-get install pgbouncer)")


@dataclass
class Bouncer:
    process: subprocess.Popen[bytes]
    port: int
    directory: Path

    def url(self, direct_url: str) -> str:
        """`direct_url` (a database on the upstream Postgres) reached through this PgBouncer."""
        parts = urlsplit(direct_url)
        user = parts.username or "postgres"
        return urlunsplit((parts.scheme, f"{user}@127.0.0.1:{self.port}", parts.path, "", ""))

    def log(self) -> str:
        return (self.directory / "pgbouncer.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)  # immediate shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def start_pgbouncer(upstream_url: str, *, pool_size: int = 20, timeout: float = 20.0) -> Bouncer:
    """A PgBouncer in transaction mode in front of the Postgres of `upstream_url`, keeping
    at most `pool_size` server connections per database.

    Raises:
        RuntimeError: pgbouncer is missing or did not start answering within `timeout`.
    """
    binary = pgbouncer_bin()
    upstream = urlsplit(upstream_url)
    user = upstream.username or "postgres"
    directory = Path(tempfile.mkdtemp(prefix="llmq-pgbouncer-"))
    directory.chmod(0o755)
    port = free_port(57400 + os.getpid() % 500)
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    config = directory / "pgbouncer.ini"
    config.write_text(
        "\n".join(
            [
                "[databases]",
                f"* = host={upstream.hostname or '127.0.0.1'} port={upstream.port or 5432}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {directory / 'users.txt'}",
                "pool_mode = transaction",
                f"default_pool_size = {pool_size}",
                "max_client_conn = 2000",
                # A restarted Postgres (the fault tier restarts it) is retried every second,
                # not after the default 15 s.
                "server_login_retry = 1",
                "server_connect_timeout = 5",
                # While Postgres is down a client waiting for a server connection gets an
                # error after 10 s (default 120 s), so an outage surfaces as it does without
                # PgBouncer: as errors (a worker retries its writes; fault test R7 needs it).
                "query_wait_timeout = 10",
                f"logfile = {directory / 'pgbouncer.log'}",
                "log_connections = 0",
                "log_disconnections = 0",
                # PgBouncer refuses to run as root; under root it switches to this user.
                *(["user = nobody"] if os.geteuid() == 0 else []),
                "",
            ]
        )
    )
    for path in directory.iterdir():
        path.chmod(0o644)
    if os.geteuid() == 0:
        log = directory / "pgbouncer.log"
        log.touch()
        shutil.chown(log, "nobody")
    process = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    bouncer = Bouncer(process, port, directory)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RuntimeError(f"pgbouncer exited at start: {err or bouncer.log()}")
        try:
            with psycopg.connect(bouncer.url(upstream_url), connect_timeout=2, prepare_threshold=None) as c:
                c.execute("SELECT 1")
            return bouncer
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                bouncer.stop()
                raise RuntimeError("pgbouncer did not start answering") from None
            time.sleep(0.1)
