"""The fault-injection harness: a real Ferry stack of separate processes, broken on purpose.

Every test gets a redis-server of its own (own port, own data directory, so it
can be killed and wiped), a PostgreSQL database of its own (``ferry_test_<hex>``),
optionally a TCP proxy in front of that database (so the database can be cut
off), the API as its own process and whichever workers and Celery processes the
scenario needs, started with ``python -m ferry`` exactly as an operator would.
Every process started here is killed at teardown, whether the test passed or
not; the Redis, the database and the proxy go too.

Each scenario counts what it submitted (202s), what reached a terminal state,
what was lost (accepted, never terminal) and what was duplicated: job ids that
workers announced more than once on the done channel. Workers publish an id
there only when their conditional terminal UPDATE won, so an id published twice
is a job recorded twice. The figures are printed as a table at the end of the
run (``pytest tests/faults -q -s``) and written as JSON under the pytest
temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import make_url

from core import migrate
from core.db import TERMINAL_STATUSES, Job, make_engine, make_sessionmaker
from core.keys import create_key
from core.queues import lane_depths
from core.streams import dead_letter_key, done_channel, workers_key
from ferry.local_redis import find_redis_server, free_port, start_redis
from tests.conftest import missing_service, postgres_database

MODEL = "sim"
START_TIMEOUT_S = 60.0
POLL_S = 0.05

# ---------------------------------------------------------------------------
# Figures: one row per scenario, printed at the end of the session.
# ---------------------------------------------------------------------------


@dataclass
class Figures:
    scenario: str
    submitted: int
    completed: int
    lost: int
    duplicated: int
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        return (
            f"{self.scenario:<28} | {self.submitted:>9} | {self.completed:>9} | "
            f"{self.lost:>4} | {self.duplicated:>10} | {self.seconds:>7.1f}"
        )


HEADER = (
    f"{'scenario':<28} | {'submitted':>9} | {'completed':>9} | "
    f"{'lost':>4} | {'duplicated':>10} | {'seconds':>7}"
)
FIGURES: list[Figures] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("=", "fault injection: nothing accepted is ever lost")
    terminalreporter.write_line(HEADER)
    terminalreporter.write_line("-" * len(HEADER))
    for figures in FIGURES:
        terminalreporter.write_line(figures.row())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    # Teardown reads this to decide whether to show the processes' logs.
    if report.failed:
        item.stash[FAILED] = True
    return report


FAILED = pytest.StashKey[bool]()


# ---------------------------------------------------------------------------
# Done-channel listener: who was recorded, and how many times.
# ---------------------------------------------------------------------------


class DoneListener:
    """Counts the job ids workers publish on the done channel.

    Resubscribes when the connection drops (Redis killed and restarted), so a
    publication after the restart is still counted.
    """

    def __init__(self, channel: str) -> None:
        self.url = ""
        self.channel = channel
        self.counts: Counter[str] = Counter()
        self.subscriptions = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="done-listener", daemon=True)

    def start(self, url: str) -> None:
        self.url = url
        self._thread.start()
        self.wait_subscribed(0)

    def wait_subscribed(self, more_than: int, timeout: float = 20.0) -> None:
        until = time.monotonic() + timeout
        while self.subscriptions <= more_than:
            assert time.monotonic() < until, "the done-channel listener could not subscribe"
            time.sleep(POLL_S)

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            client = redis.Redis.from_url(
                self.url, decode_responses=True, socket_connect_timeout=1, socket_timeout=5
            )
            pubsub = client.pubsub()
            try:
                pubsub.subscribe(self.channel)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.2)
                    if message is None:
                        continue
                    if message["type"] == "subscribe":
                        self.subscriptions += 1
                    elif message["type"] == "message":
                        ids = [i for i in str(message["data"]).split(",") if i]
                        with self._lock:
                            self.counts.update(ids)
            except (redis.RedisError, OSError):
                self._stop.wait(0.1)
            finally:
                with contextlib.suppress(Exception):
                    pubsub.close()
                client.close()


# ---------------------------------------------------------------------------
# A TCP proxy in front of PostgreSQL, so the database can be made unreachable.
# ---------------------------------------------------------------------------


class TcpProxy:
    """Forwards 127.0.0.1:port to a target; ``cut()`` refuses and severs, ``restore()`` heals."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener: socket.socket | None = self._listen(0)
        self.port = int(self._listener.getsockname()[1])
        self.connections = 0
        self.severed = 0
        self._thread = threading.Thread(target=self._accept_loop, name="db-proxy", daemon=True)
        self._thread.start()

    @staticmethod
    def _listen(port: int) -> socket.socket:
        listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        listener.settimeout(0.1)
        return listener

    def cut(self) -> None:
        """Refuse new connections (the port is closed) and sever every open one."""
        with self._lock:
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            severed = list(self._sockets)
            self._sockets.clear()
        for sock in severed:
            self.severed += 1
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def restore(self) -> None:
        with self._lock:
            if self._listener is None:
                self._listener = self._listen(self.port)

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            listener = self._listener
            if listener is None:
                time.sleep(POLL_S)
                continue
            try:
                client, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is None:  # cut while connecting
                    client.close()
                    upstream.close()
                    continue
                self._sockets.update((client, upstream))
                self.connections += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


# ---------------------------------------------------------------------------
# Processes.
# ---------------------------------------------------------------------------


@dataclass
class Proc:
    """One `python -m ferry ...` process (restarted in place when supervised)."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    supervised: bool = False
    popen: subprocess.Popen[bytes] | None = None
    exits: list[int] = field(default_factory=list)
    starts: int = 0

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class Submission:
    """What a burst of submissions got: the accepted ids, in the order of the bodies."""

    ids: dict[int, str] = field(default_factory=dict)
    retried: Counter[str] = field(default_factory=Counter)  # 503s and transport errors
    rejected: list[tuple[int, int, str]] = field(default_factory=list)  # (index, status, body)
    seconds: float = 0.0  # how long submitting took
    # Retried after a 503 or a dropped connection, then answered with the job
    # the failed attempt had created after all (Idempotent-Replayed: true).
    replayed: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> list[str]:
        return [self.ids[i] for i in sorted(self.ids)]


@dataclass
class Accounting:
    figures: Figures
    rows: dict[str, Any]  # job id -> row (id, status, attempts, error, ...)
    published: Counter[str]


class Stack:
    """A Ferry stack of real processes around one Redis and one PostgreSQL database."""

    def __init__(
        self, tmp: Path, database_url: str, env: dict[str, str], proxy_db: bool = False
    ) -> None:
        self.tmp = tmp
        self.prefix = f"ferryfault-{secrets.token_hex(3)}"
        self.database_url = database_url  # direct: what the harness checks with
        # Everything close() releases, before anything is started.
        self.proxy: TcpProxy | None = None
        self.redis_process: subprocess.Popen[bytes] | None = None
        self.procs: dict[str, Proc] = {}
        self._all: list[subprocess.Popen[bytes]] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self.listener = DoneListener(done_channel(self.prefix))
        self.engine: Engine = make_engine(database_url)
        self._local = threading.local()
        try:
            self._start(env, proxy_db)
        except BaseException:
            self.close()
            raise

    def _start(self, env: dict[str, str], proxy_db: bool) -> None:
        app_database_url = self.database_url
        if proxy_db:
            url = make_url(self.database_url)
            self.proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
            app_database_url = url.set(host="127.0.0.1", port=self.proxy.port).render_as_string(
                hide_password=False
            )
        self.redis_port = free_port()
        self.redis_dir = self.tmp / "redis-data"
        self.start_redis()
        self.redis = redis.Redis.from_url(
            self.redis_url, decode_responses=True, socket_connect_timeout=1, socket_timeout=5
        )
        self.api_port = free_port()
        self.base = f"http://127.0.0.1:{self.api_port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        self.env.update(
            FERRY_REDIS_URL=self.redis_url,
            FERRY_DATABASE_URL=app_database_url,
            FERRY_KEY_PREFIX=self.prefix,
            FERRY_DATA_DIR=str(self.tmp / "data"),
            FERRY_API_PORT=str(self.api_port),
            FERRY_MODELS=MODEL,
            FERRY_LOG_LEVEL="INFO",
            PYTHONUNBUFFERED="1",
        )
        self.env.update(env)
        self.max_attempts = int(self.env.get("FERRY_MAX_ATTEMPTS", "3"))
        with make_sessionmaker(self.engine)() as session:
            self.token = create_key(session, "faults").token
        self._supervisor.start()
        self.listener.start(self.redis_url)

    # -- Redis ------------------------------------------------------------

    def start_redis(self) -> None:
        process, url = start_redis(self.redis_dir, self.redis_port)
        self.redis_process, self.redis_url = process, url

    def kill_redis(self, wipe: bool) -> None:
        """kill -9 the redis-server; with ``wipe``, its data directory goes too."""
        assert self.redis_process is not None
        self.redis_process.kill()
        self.redis_process.wait(timeout=10)
        if self.redis_process.stderr:
            self.redis_process.stderr.close()
        self.redis_process = None
        if wipe:
            shutil.rmtree(self.redis_dir)

    # -- processes --------------------------------------------------------

    def spawn(self, name: str, args: list[str], supervised: bool = False, **env: str) -> Proc:
        proc = Proc(
            name=name,
            args=[sys.executable, "-m", "ferry", *args],
            env={**self.env, **env},
            log=self.tmp / f"{name}.log",
            supervised=supervised,
        )
        with self._lock:
            self.procs[name] = proc
            self._launch(proc)
        return proc

    def _launch(self, proc: Proc) -> None:
        proc.starts += 1
        with proc.log.open("ab") as log:
            log.write(f"--- start {proc.starts} at {time.time():.3f}\n".encode())
            # A session of its own: a signal for pytest never reaches it, and
            # teardown can kill exactly this process (and anything it forked).
            proc.popen = subprocess.Popen(
                proc.args,
                env=proc.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.tmp,
                start_new_session=True,
            )
        self._all.append(proc.popen)

    def _supervise(self) -> None:
        """Restart supervised processes that exit, as `ferry up` does (no backoff)."""
        while not self._stop.wait(POLL_S):
            with self._lock:
                for proc in self.procs.values():
                    if proc.supervised and proc.popen is not None:
                        code = proc.popen.poll()
                        if code is not None:
                            proc.exits.append(code)
                            self._launch(proc)

    def start_api(self) -> Proc:
        proc = self.spawn("api", ["api"])
        until = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return proc
            assert proc.alive(), f"the API exited at start:\n{self.tail(proc)}"
            assert time.monotonic() < until, f"the API was not ready:\n{self.tail(proc)}"
            time.sleep(0.1)

    def start_worker(self, name: str, supervised: bool = False, wait: bool = True) -> Proc:
        proc = self.spawn(name, ["worker", "--model", MODEL, "--name", name], supervised)
        if wait:
            self.wait_worker(proc)
        return proc

    def wait_worker(self, proc: Proc) -> None:
        """Until the worker's heartbeat is in Redis (it has joined the group and reads)."""
        until = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(redis.RedisError):
                if self.redis.zscore(workers_key(self.prefix, MODEL), proc.name) is not None:
                    return
            assert proc.supervised or proc.alive(), f"{proc.name} exited:\n{self.tail(proc)}"
            assert time.monotonic() < until, f"{proc.name} never beat:\n{self.tail(proc)}"
            time.sleep(POLL_S)

    def signal(self, proc: Proc, signum: int) -> None:
        assert proc.popen is not None
        proc.popen.send_signal(signum)

    def kill(self, proc: Proc) -> int:
        """kill -9, and no restart."""
        with self._lock:
            proc.supervised = False
            assert proc.popen is not None
            proc.popen.kill()
            code = proc.popen.wait(timeout=10)
            proc.exits.append(code)
            return code

    def tail(self, proc: Proc, chars: int = 3000) -> str:
        try:
            return proc.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def log_lines(self, proc: Proc) -> list[dict[str, Any]]:
        """The process's JSON log records (other lines skipped)."""
        records = []
        for line in proc.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
        return records

    def count_logs(self, proc: Proc, *messages: str) -> int:
        return sum(1 for record in self.log_lines(proc) if record.get("msg") in messages)

    def reenqueued(self, proc: Proc) -> int:
        """How many jobs the reconciler (in this Celery worker) re-enqueued."""
        return sum(
            int(record.get("count", 0))
            for record in self.log_lines(proc)
            if record.get("msg") == "re-enqueued jobs whose stream entry was lost"
        )

    def diagnostics(self, lines: int = 25) -> str:
        """Each process's exits and its last warnings, errors and non-JSON lines."""
        parts = []
        for proc in self.procs.values():
            kept = []
            for line in proc.log.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if isinstance(record, dict) and record.get("level") in ("info", "debug"):
                    continue
                kept.append(line[:600])
            parts.append(
                f"==== {proc.name} (starts {proc.starts}, exits {proc.exits}, log {proc.log})\n"
                + "\n".join(kept[-lines:])
            )
        return "\n".join(parts)

    # -- the API ------------------------------------------------------------

    def _client(self) -> httpx.Client:
        client: httpx.Client | None = getattr(self._local, "client", None)
        if client is None:
            client = httpx.Client(
                base_url=self.base,
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=httpx.Timeout(10.0, connect=2.0),
            )
            self._local.client = client
        return client

    def submit_one(
        self, body: dict[str, Any], into: Submission, index: int, retry_s: float
    ) -> None:
        """POST until a 202, retrying 503s and dropped connections with the same idempotency key.

        A client that lost its answer cannot know whether the job was accepted;
        the idempotency key makes the retry return the original job instead of
        a second one.
        """
        key = uuid.uuid4().hex
        until = time.monotonic() + retry_s
        pause = 0.1
        while not self._stop.is_set():
            try:
                response = self._client().post(
                    "/v1/jobs", json=body, headers={"Idempotency-Key": key}
                )
            except httpx.TransportError as exc:
                into.retried[type(exc).__name__] += 1
            else:
                if response.status_code == 202:
                    into.ids[index] = str(response.json()["id"])
                    if response.headers.get("Idempotent-Replayed") == "true":
                        into.replayed.append(index)
                    return
                if response.status_code != 503:
                    into.rejected.append((index, response.status_code, response.text[:500]))
                    return
                into.retried["503"] += 1
            if time.monotonic() > until:
                into.rejected.append((index, 0, "gave up retrying"))
                return
            self._stop.wait(pause)
            pause = min(pause * 2, 1.0)

    def submit(
        self, bodies: list[dict[str, Any]], threads: int = 6, retry_s: float = 60.0
    ) -> Submission:
        submission = Submission()
        started = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            for index, body in enumerate(bodies):
                pool.submit(self.submit_one, body, submission, index, retry_s)
        submission.seconds = time.monotonic() - started
        return submission

    def submit_in_background(
        self, bodies: list[dict[str, Any]], threads: int = 6, retry_s: float = 60.0
    ) -> tuple[Submission, Future[None]]:
        submission = Submission()
        pool = ThreadPoolExecutor(threads)

        def all_of_them() -> None:
            started = time.monotonic()
            futures = [
                pool.submit(self.submit_one, body, submission, index, retry_s)
                for index, body in enumerate(bodies)
            ]
            for future in futures:
                future.result()
            pool.shutdown()
            submission.seconds = time.monotonic() - started

        runner = ThreadPoolExecutor(1)
        done = runner.submit(all_of_them)
        runner.shutdown(wait=False)
        return submission, done

    # -- the database ---------------------------------------------------------

    def statuses(self, ids: list[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for job_id, status in conn.execute(
                    select(Job.id, Job.status).where(Job.id.in_(chunk))
                ):
                    found[job_id] = status
        return found

    def terminal_count(self) -> int:
        with self.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(Job).where(Job.status.in_(TERMINAL_STATUSES))
                ).scalar_one()
            )

    def rows(self, ids: list[str]) -> dict[str, Any]:
        found: dict[str, Any] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 1000):
                chunk = ids[start : start + 1000]
                for row in conn.execute(
                    select(
                        Job.id, Job.status, Job.attempts, Job.error, Job.output,
                        Job.batch_size, Job.started_at, Job.finished_at,
                    ).where(Job.id.in_(chunk))
                ):  # fmt: skip
                    found[row.id] = row
        return found

    def wait_terminal(self, ids: list[str], timeout: float) -> bool:
        """Until every id is terminal (True), or the deadline (False)."""
        until = time.monotonic() + timeout
        waiting = list(ids)
        while waiting:
            with contextlib.suppress(Exception):
                found = self.statuses(waiting)
                waiting = [i for i in waiting if found.get(i) not in TERMINAL_STATUSES]
            if not waiting:
                return True
            if time.monotonic() > until:
                return False
            time.sleep(0.25)
        return True

    def stream_entries(self) -> int:
        """Entries still in the model's lane streams (acknowledged ones are deleted)."""
        return sum(lane_depths(self.redis, self.prefix, MODEL).values())

    def dead_letters(self) -> list[dict[str, str]]:
        entries: Any = self.redis.xrange(dead_letter_key(self.prefix, MODEL))
        return [dict(fields) for _id, fields in entries]

    def wait_quiet(self, timeout: float = 10.0) -> int:
        """Until the lane streams are empty; returns what is left at the deadline."""
        until = time.monotonic() + timeout
        while True:
            left = -1
            with contextlib.suppress(redis.RedisError):
                left = self.stream_entries()
                if left == 0:
                    return 0
            if time.monotonic() > until:
                return left
            time.sleep(0.1)

    # -- accounting -----------------------------------------------------------

    def account(
        self,
        scenario: str,
        submission: Submission,
        started: float,
        timeout: float,
        record: Callable[[Figures], None],
    ) -> Accounting:
        """Wait for every accepted job to end, then count: completed, lost, duplicated."""
        accepted = submission.accepted
        self.wait_terminal(accepted, timeout)
        seconds = time.monotonic() - started
        left = self.wait_quiet()
        time.sleep(0.5)  # a publication racing the last commit
        published = self.listener.snapshot()
        rows = self.rows(accepted)
        terminal = {i for i, r in rows.items() if r.status in TERMINAL_STATUSES}
        duplicated = sorted(i for i, n in published.items() if n > 1)
        bad_attempts = sorted(
            i
            for i, r in rows.items()
            if r.status in ("succeeded", "failed") and not 1 <= r.attempts <= self.max_attempts
        )
        figures = Figures(
            scenario=scenario,
            submitted=len(accepted),
            completed=len(terminal),
            lost=len(accepted) - len(terminal),
            duplicated=len(duplicated),
            seconds=round(seconds, 1),
            details={
                "statuses": dict(Counter(r.status for r in rows.values())),
                "missing_rows": len(accepted) - len(rows),
                "attempts": dict(sorted(Counter(r.attempts for r in rows.values()).items())),
                "bad_attempts": len(bad_attempts),
                "published_ids": len(published),
                "unpublished_terminal": len(terminal - set(published)),
                "duplicated_ids": duplicated[:20],
                "lost_ids": sorted(set(accepted) - terminal)[:20],
                "rejected": submission.rejected[:20],
                "retried": dict(submission.retried),
                "submit_s": round(submission.seconds, 1),
                "replayed_after_retry": len(submission.replayed),
                "stream_entries_left": left,
                # Rows no 202 answered for (a request that failed after its commit
                # and was not retried): work nobody knows was accepted.
                "orphan_rows": self.row_count() - len(rows),
                "restarts": {p.name: p.exits for p in self.procs.values() if p.exits},
            },
        )
        record(figures)
        return Accounting(figures, rows, published)

    def row_count(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(Job)).scalar_one())

    def assert_nothing_lost(self, accounting: Accounting) -> None:
        f = accounting.figures
        context = f"{json.dumps(asdict(f), default=str, indent=1)}\n{self.diagnostics()}"
        assert not f.details["rejected"], context
        assert f.submitted > 0, context
        assert f.lost == 0, context
        assert f.duplicated == 0, context
        assert f.details["bad_attempts"] == 0, context
        assert f.details["orphan_rows"] == 0, context

    # -- teardown ---------------------------------------------------------------

    def close(self) -> None:
        """Kill every process this stack started, then Redis, the proxy and the listener."""
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=5)
        with self._lock:
            for proc in self.procs.values():
                proc.supervised = False
            for popen in self._all:
                if popen.poll() is None:
                    # Its own session (start_new_session): the group is just it.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(popen.pid, signal.SIGKILL)
            for popen in self._all:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=10)
        self.listener.stop()
        if hasattr(self, "redis"):
            self.redis.close()
        if self.redis_process is not None:
            self.redis_process.kill()
            self.redis_process.wait(timeout=10)
            if self.redis_process.stderr:
                self.redis_process.stderr.close()
        if self.proxy is not None:
            self.proxy.close()
        self.engine.dispose()


# ---------------------------------------------------------------------------
# Fixtures.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def migrated_postgres_database() -> Iterator[str]:
    """A migrated PostgreSQL database of this test's own, dropped afterwards."""
    with postgres_database() as url:
        migrate.upgrade(url)
        yield url


@pytest.fixture(scope="session")
def figures_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "faults-figures.json"


@pytest.fixture
def record(tmp_path: Path, figures_file: Path) -> Iterator[Callable[[Figures], None]]:
    """Keep a scenario's figures: printed at the end, and written as JSON.

    The JSON is written when the test ends, so what a test adds to the details
    after counting is in it too.
    """
    mine: list[Figures] = []

    def keep(figures: Figures) -> None:
        FIGURES.append(figures)
        mine.append(figures)
        print(f"\n{HEADER}\n{figures.row()}")

    yield keep
    if mine:
        (tmp_path / "figures.json").write_text(
            json.dumps([asdict(f) for f in mine], default=str, indent=1)
        )
        figures_file.write_text(json.dumps([asdict(f) for f in FIGURES], default=str, indent=1))


@pytest.fixture
def make_stack(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Generator[Callable[..., Stack], None, None]:
    """Builds the test's stack: ``make_stack(proxy_db=False, FERRY_X="...")``."""
    try:
        find_redis_server()
    except SystemExit as exc:
        missing_service(str(exc))
    with contextlib.ExitStack() as cleanup:
        stacks: list[Stack] = []

        def build(proxy_db: bool = False, **env: str) -> Stack:
            url = cleanup.enter_context(migrated_postgres_database())
            stack = Stack(tmp_path, url, env, proxy_db=proxy_db)
            stacks.append(stack)
            return stack

        try:
            yield build
        finally:
            for stack in stacks:
                if request.node.stash.get(FAILED, False):
                    print(f"\n---- process logs ({tmp_path}) ----\n{stack.diagnostics()}")
                stack.close()


def sim_jobs(count: int, costs: tuple[int, ...] = (1, 2, 3, 4)) -> list[dict[str, Any]]:
    return [{"model": MODEL, "input": {"cost": costs[i % len(costs)]}} for i in range(count)]


def wait_for(
    what: str, condition: Callable[[], bool], timeout: float, poll: float = POLL_S
) -> None:
    until = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(poll)
