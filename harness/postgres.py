"""PostgreSQL servers of a test's own, to stop, restart, kill and fail over.

The scenarios that break the database server itself (not a connection to it)
need a server nobody else uses: ``postgres_servers()`` makes each with
``initdb`` in a temporary directory, on a free loopback port, starts and stops
it with ``pg_ctl``, and makes a streaming replica of one with
``pg_basebackup -R``. When the block ends, whatever happened in it, every
server still running is stopped (immediate mode) and the directory removed.

PostgreSQL refuses to run as root: as root, the servers run as the
``postgres`` user, in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text

from harness.ports import free_port
from harness.services import ServiceMissing

PG_CTL_WAIT_S = 60
# What the servers differ in from initdb's defaults. Ferry's processes hold up to 40
# connections each (FERRY_DB_POOL_SIZE + FERRY_DB_POOL_OVERFLOW, by default); the small
# shared_buffers leaves the memory to the test's other processes.
SETTINGS = [
    "listen_addresses = '127.0.0.1'",
    "max_connections = 300",
    "shared_buffers = 32MB",
]


def _programs() -> Path:
    initdb = shutil.which("initdb")
    if initdb is None:
        raise ServiceMissing("initdb is not on PATH (PostgreSQL's server programs)")
    return Path(initdb).resolve().parent


def _program(name: str) -> str:
    """``name`` beside initdb (the same version), else on PATH."""
    beside = _programs() / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise ServiceMissing(f"{name} is not on PATH")
    return found


def _run_as() -> str | None:
    """The user the servers run as: ``postgres`` when this process is root, else this one."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceMissing(
            "running as root, and there is no postgres user to run PostgreSQL"
        ) from None
    return "postgres"


class PostgresServer:
    """One server: its data directory, its port, and ``pg_ctl`` to start and stop it."""

    def __init__(self, home: Path, name: str, user: str | None) -> None:
        self.name = name
        self.home = home
        self.data = home / name
        self.log = home / f"{name}.log"
        self.port = free_port()
        self.user = user

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A PostgreSQL program as the servers' user; its output in the error if it fails."""
        done = subprocess.run(
            args, user=self.user, cwd=self.home, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} exited {done.returncode}: {done.stdout}{done.stderr}\n"
                f"{self.log_tail()}"
            )
        return done

    def pg_ctl(self, *args: str) -> None:
        self.run(_program("pg_ctl"), "-D", str(self.data), "-w", "-t", str(PG_CTL_WAIT_S), *args)

    def start(self) -> None:
        """Start, and wait until it takes connections (read-only ones, for a standby)."""
        options = f"-p {self.port} -k {self.home}"
        self.pg_ctl("-l", str(self.log), "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``: fast ends every session and checkpoints, immediate is a
        crash (no checkpoint, the next start replays the WAL)."""
        self.pg_ctl("-m", mode, "stop")

    def promote(self) -> None:
        """Make a standby the primary, and wait until it takes writes."""
        self.pg_ctl("promote")

    def running(self) -> bool:
        status = subprocess.run(
            [_program("pg_ctl"), "-D", str(self.data), "status"],
            user=self.user,
            capture_output=True,
            check=False,
        )
        return status.returncode == 0

    def query(self, statement: str, database: str = "postgres") -> list[Any]:
        """The rows of one statement, run outside a transaction."""
        engine = create_engine(
            self.url(database), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
        )
        try:
            with engine.connect() as conn:
                result = conn.execute(text(statement))
                return list(result) if result.returns_rows else []
        finally:
            engine.dispose()

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class PostgresServers:
    """The servers of one test, in one temporary directory."""

    def __init__(self) -> None:
        self.user = _run_as()
        _programs()
        self.home = Path(tempfile.mkdtemp(prefix="ferry-pg-"))
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.home, entry.pw_uid, entry.pw_gid)
        self.servers: list[PostgresServer] = []

    def primary(self, name: str = "primary") -> PostgresServer:
        """A new cluster (initdb, trust authentication), started."""
        server = self._new(name)
        server.run(
            _program("initdb"),
            "-D",
            str(server.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        )
        with (server.data / "postgresql.conf").open("a") as conf:
            conf.write("\n".join(SETTINGS) + "\n")
        server.start()
        return server

    def replica(
        self, primary: PostgresServer, name: str = "replica", synchronous: bool = True
    ) -> PostgresServer:
        """A streaming replica of ``primary`` (``pg_basebackup -R``), started and streaming.

        ``synchronous``: the primary then commits only once the replica has flushed
        the commit's WAL (``synchronous_standby_names``), so promoting the replica
        loses no committed transaction. The replica itself names no standby: once
        promoted, it commits alone.
        """
        server = self._new(name)
        server.run(
            _program("pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(primary.port),
            "-U",
            "postgres",
            "-D",
            str(server.data),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",  # a checkpoint now, not one spread over minutes
        )
        with (server.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"cluster_name = '{name}'\nsynchronous_standby_names = ''\n")
        server.start()
        standby = f"SELECT 1 FROM pg_stat_replication WHERE application_name = '{name}'"
        self._wait(primary, f"{standby} AND state = 'streaming'", f"{name} to stream")
        if synchronous:
            primary.query(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            primary.query("SELECT pg_reload_conf()")
            self._wait(primary, f"{standby} AND sync_state = 'sync'", f"{name} to be synchronous")
        return server

    def _new(self, name: str) -> PostgresServer:
        server = PostgresServer(self.home, name, self.user)
        self.servers.append(server)
        return server

    @staticmethod
    def _wait(server: PostgresServer, statement: str, what: str, timeout_s: float = 30) -> None:
        until = time.monotonic() + timeout_s
        while not server.query(statement):
            if time.monotonic() > until:
                raise RuntimeError(f"timed out waiting for {what}\n{server.log_tail()}")
            time.sleep(0.1)

    def close(self) -> None:
        """Stop every server still running (immediate: nothing is kept), remove the directory."""
        for server in self.servers:
            if server.data.is_dir() and server.running():
                with contextlib.suppress(RuntimeError):
                    server.stop("immediate")
        shutil.rmtree(self.home, ignore_errors=True)


@contextlib.contextmanager
def postgres_servers() -> Iterator[PostgresServers]:
    """Servers of the block's own (``.primary()``, ``.replica(primary)``), gone afterwards."""
    servers = PostgresServers()
    try:
        yield servers
    finally:
        servers.close()


def create_database(server: PostgresServer, name: str) -> str:
    """A new database on ``server``; its URL."""
    server.query(f'CREATE DATABASE "{name}"')
    return server.url(name)


def failover_url(database: str, *servers: PostgresServer) -> str:
    """One URL naming every server, that connects to whichever takes writes.

    libpq tries the hosts in order and, with ``target_session_attrs=read-write``,
    passes over one that is down or is a standby; SQLAlchemy gives each ``host``
    parameter to psycopg as one of libpq's hosts.
    """
    hosts = "&".join(f"host=127.0.0.1:{server.port}" for server in servers)
    return f"postgresql+psycopg://postgres@/{database}?{hosts}&target_session_attrs=read-write"
