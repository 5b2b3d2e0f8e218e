"""Redis with Sentinel, for tests and benchmarks: a primary, a replica and three sentinels,
each a ``redis-server`` of its own on a free loopback port, stopped afterwards; and the
failover under load that the test checks and the benchmark times."""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker
from harness import webclient
from harness.served import served
from harness.services import redis_server, redis_started, stop_all
from harness.settling import reconciling, settled
from harness.worker import running_worker

DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class SentinelRedis:
    """``with SentinelRedis(tmp) as found:`` then ``found.sentinels`` for FERRY_REDIS_SENTINELS."""

    def __init__(self, tmp: Path, service: str = "ferry") -> None:
        self.tmp = tmp
        self.service = service
        self.program = redis_server()
        self.ports: dict[str, int] = {}  # "primary" and "replica", once started
        self.sentinel_ports: list[int] = []
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def sentinels(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.sentinel_ports]

    def _start(self, lines: list[str], sentinel: bool = False) -> int:
        """A server of the set, on a port of its own, answering; its port."""
        port, process = redis_started(
            self.program, self.tmp, lines, *(["--sentinel"] if sentinel else [])
        )
        self.processes[port] = process
        return port

    def __enter__(self) -> SentinelRedis:
        try:
            primary = self.ports["primary"] = self._start([])
            self.ports["replica"] = self._start([f"replicaof 127.0.0.1 {primary}"])
            monitor = [
                f"sentinel monitor {self.service} 127.0.0.1 {primary} 2",
                f"sentinel down-after-milliseconds {self.service} {DOWN_AFTER_MS}",
                f"sentinel failover-timeout {self.service} {FAILOVER_TIMEOUT_MS}",
                f"sentinel parallel-syncs {self.service} 1",
            ]
            self.sentinel_ports += [self._start(monitor, sentinel=True) for _ in range(3)]
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until the replica copies the primary and every sentinel knows both and the others.

        A sentinel learns of the replica from the primary's INFO, every 10 s, and of the
        other sentinels from their hellos, every 2 s: on a loaded machine that can take
        tens of seconds, so only a hang reaches ``timeout_s``."""
        until = time.monotonic() + timeout_s
        replica = redis.Redis(port=self.ports["replica"], socket_timeout=1)
        missing = "nothing asked yet"
        while True:
            try:
                if replica.info("replication").get("master_link_status") != "up":
                    missing = "the replica's link to the primary"
                else:
                    missing = ""
                    for port in self.sentinel_ports:
                        if not self._ask(port, "SENTINEL", "REPLICAS", self.service):
                            missing = f"the replica, as sentinel {port} knows it"
                        elif len(self._ask(port, "SENTINEL", "SENTINELS", self.service)) != 2:
                            missing = f"the other sentinels, as sentinel {port} knows them"
                    if not missing:
                        return
            except redis.RedisError as exc:
                missing = f"an answer ({type(exc).__name__}: {exc})"
            if time.monotonic() > until:
                raise AssertionError(f"Redis with Sentinel did not come up: no {missing}")
            time.sleep(0.2)

    def _ask(self, port: int, *command: str) -> list[object]:
        client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        try:
            return list(client.execute_command(*command) or [])
        finally:
            client.close()

    def primary_port(self) -> int | None:
        """The primary's port as the sentinels see it now (None: none answers)."""
        for port in self.sentinel_ports:
            try:
                found = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
            except redis.RedisError:
                continue
            if found:
                return int(str(found[1]))
        return None

    def kill_primary(self) -> int:
        """SIGKILL the primary (what it had not yet sent its replica is lost); its port."""
        port = self.primary_port()
        assert port is not None
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(timeout=10)
        return port

    def wait_promoted(self, old: int, timeout_s: float = 30.0) -> int:
        """Until the sentinels name another primary; its port."""
        until = time.monotonic() + timeout_s
        while (port := self.primary_port()) in (None, old):
            if time.monotonic() > until:
                raise AssertionError("no replica was promoted")
            time.sleep(0.1)
        assert port is not None
        return port

    def __exit__(self, *_exc: object) -> None:
        stop_all(self.processes.values())


@dataclass(frozen=True)
class Failover:
    """What a failover under load did to the jobs."""

    sent: int
    accepted: list[str]  # the accepted jobs' ids
    refused: list[int]  # the status codes of the submissions refused
    requeued: int  # jobs the reconciler enqueued again
    killed: int  # the killed primary's port
    promoted: int  # the port of the replica promoted in its place
    recovered_s: float | None  # killed -> the first job accepted after it finished
    jobs: dict[str, Job]  # the accepted jobs' rows at the end


def failover_under_load(
    sentinel: SentinelRedis,
    settings: Settings,
    *,
    load_s: float = 14.0,
    kill_at_s: float = 4.0,
    rate: float = 25.0,
    settle_s: float = 60.0,
) -> Failover:
    """Submit sim jobs at ``rate`` for ``load_s`` through the API (uvicorn, this process)
    to a sim worker, the reconciler running as beat runs it; SIGKILL the primary at
    ``kill_at_s``; then wait up to ``settle_s`` for every accepted job to finish."""
    engine = make_engine(settings.sqlalchemy_url)
    sessions: sessionmaker[Session] = make_sessionmaker(engine)
    with sessions() as session:
        token = create_key(session, "failover").token
    accepted: list[tuple[float, str]] = []  # (wall clock, job id)
    refused: list[int] = []
    killed = killed_at = None
    sent = 0
    with (
        served(settings) as api,
        running_worker(settings, "sim", "failover-worker"),
        reconciling(settings) as requeued,
    ):
        started = time.monotonic()
        with webclient.client(
            base_url=api.base, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as client:
            while (elapsed := time.monotonic() - started) < load_s:
                if killed is None and elapsed >= kill_at_s:
                    killed, killed_at = sentinel.kill_primary(), time.time()
                if sent >= elapsed * rate:
                    time.sleep(0.005)
                    continue
                sent += 1
                answer = client.post("/v1/jobs", json={"model": "sim", "input": {"cost": 2}})
                if answer.status_code == 202:
                    accepted.append((time.time(), answer.json()["id"]))
                else:
                    refused.append(answer.status_code)
        assert killed is not None and killed_at is not None
        promoted = sentinel.wait_promoted(killed)
        ids = [job_id for _, job_id in accepted]
        jobs = settled(sessions, ids, settle_s)
    engine.dispose()
    finished_after = [
        jobs[job_id].finished_at
        for at, job_id in accepted
        if at > killed_at and jobs[job_id].finished_at is not None
    ]
    recovered_s = (
        min(moment.timestamp() for moment in finished_after if moment) - killed_at
        if finished_after
        else None
    )
    return Failover(sent, ids, refused, sum(requeued), killed, promoted, recovered_s, jobs)
