"""Test hosts in network namespaces: a bridge of their own, addresses from the
benchmarking range (198.18.0.0/15), and links that can be cut and restored.

Each host is a network namespace joined to the bridge by a veth pair; this
process (the test) reaches every host through the bridge's own address, and no
traffic leaves the machine. Needs root and iproute2; anything else raises
:class:`~harness.services.ServiceMissing` with the reason.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from harness.locks import try_lock
from harness.services import ServiceMissing

# Each network takes a /24 of the benchmarking range (RFC 2544), 198.18.N.0, that no
# other network on this machine holds at the same time: two bridges with one subnet
# would route a test's packets to whichever was made last.
RANGE = "198.18"
PREFIX = 24
SUBNETS = 256
LOCKS = Path(tempfile.gettempdir()) / "ferry-netns"


BRIDGE_PREFIX = "fbr"


def claim_subnet() -> tuple[str, IO[bytes]]:
    """The first 198.18.N of this machine's free ones, and the open lock file that holds it
    (closed, or the process gone, it is free again).

    A free lock does not make a free subnet: a test process killed outright (SIGKILL, or
    its machine's session ended under it) never ran ``Network.__exit__``, and its bridge
    still holds 198.18.N.1, which would take the new network's packets. Such a bridge is
    a test network's (its name says so) whose owner is gone (its lock was free): it is
    removed, with its hosts. A subnet held by any other interface is skipped."""
    LOCKS.mkdir(exist_ok=True)
    for number in range(SUBNETS):
        subnet = f"{RANGE}.{number}"
        lock = try_lock(LOCKS / f"{subnet}.lock")
        if lock is None:
            continue
        holders = interfaces_in(subnet)
        if any(not name.startswith(BRIDGE_PREFIX) for name in holders):
            lock.close()
            continue
        for bridge in holders:
            remove_stale_network(bridge)
        return subnet, lock
    raise ServiceMissing(f"all {SUBNETS} test subnets of {RANGE}.0.0/16 are taken")


def interfaces_in(subnet: str) -> list[str]:
    """The names of this machine's interfaces with an IPv4 address in ``subnet``.0/24."""
    listing = subprocess.run(
        ["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    names = []
    for line in listing.splitlines():
        # "7: fbr1a2b    inet 198.18.0.1/24 scope global fbr1a2b ..."
        fields = line.split()
        if len(fields) >= 4 and fields[3].split("/")[0].rsplit(".", 1)[0] == subnet:
            names.append(fields[1])
    return names


def remove_stale_network(bridge: str) -> None:
    """Remove a dead test network: its hosts' namespaces (their processes killed) and its
    bridge."""
    tag = bridge.removeprefix(BRIDGE_PREFIX)
    listing = subprocess.run(
        ["ip", "netns", "list"], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    for namespace in (line.split()[0] for line in listing.splitlines() if line.strip()):
        if not namespace.startswith(f"ferry-{tag}-"):
            continue
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
    subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def check_can_build() -> None:
    """Raise ServiceMissing unless namespaces, veths and bridges can be made here."""
    if os.geteuid() != 0:
        raise ServiceMissing("test hosts in network namespaces need root")
    if shutil.which("ip") is None:
        raise ServiceMissing("test hosts need iproute2's ip command")


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    link: str  # the veth end on the bridge: down cuts the host off
    home: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(
        self,
        args: list[str],
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        log: str = "process",
    ) -> subprocess.Popen[bytes]:
        """``args`` run inside the host's namespace (as ``user``, when given)."""
        command = ["ip", "netns", "exec", self.namespace]
        if user:
            command += ["runuser", "-u", user, "--"]
        sink: IO[bytes] = (self.home / f"{log}.log").open("ab")
        process = subprocess.Popen(
            [*command, *args], env=dict(env or os.environ), stdout=sink, stderr=subprocess.STDOUT
        )
        self.processes.append(process)
        return process

    def run(self, args: list[str], user: str | None = None, timeout: float = 120) -> None:
        command = ["ip", "netns", "exec", self.namespace]
        if user:
            command += ["runuser", "-u", user, "--"]
        subprocess.run([*command, *args], check=True, capture_output=True, timeout=timeout)

    def cut(self) -> None:
        """Take the host off the network (its processes keep running)."""
        _ip("link", "set", self.link, "down")

    def restore(self) -> None:
        _ip("link", "set", self.link, "up")

    def block(self, address: str) -> None:
        """This host can no longer reach ``address`` (every other host still can)."""
        _ip("-n", self.namespace, "route", "add", "unreachable", f"{address}/32")

    def unblock(self, address: str) -> None:
        _ip("-n", self.namespace, "route", "del", "unreachable", f"{address}/32")

    def log(self, name: str = "process", chars: int = 3000) -> str:
        path = self.home / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def stop(self, process: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> None:
        if process.poll() is None:
            process.send_signal(signum)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


class Network:
    """``with Network(tmp) as net: net.host("redis")`` ... torn down on exit, whatever happened."""

    def __init__(self, tmp: Path) -> None:
        check_can_build()
        self.tmp = tmp
        self.tag = secrets.token_hex(2)
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self.subnet, self._subnet_lock = claim_subnet()
        self.gateway = f"{self.subnet}.1"
        self.hosts: dict[str, Host] = {}
        self.cleanup: list[Path] = []  # folders made outside tmp, removed at the end

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/{PREFIX}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        except BaseException:
            # __exit__ does not run when __enter__ raises: undo the bridge, free the subnet.
            self.__exit__()
            raise
        return self

    def host(self, name: str) -> Host:
        number = len(self.hosts) + 2
        namespace = f"ferry-{self.tag}-{name}"
        outer, inner = f"fv{self.tag}{number}", f"fi{self.tag}{number}"
        address = f"{self.subnet}.{number}"
        _ip("netns", "add", namespace)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", namespace)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", namespace, "addr", "add", f"{address}/{PREFIX}", "dev", inner)
        _ip("-n", namespace, "link", "set", inner, "up")
        _ip("-n", namespace, "link", "set", "lo", "up")
        home = self.tmp / name
        home.mkdir(parents=True, exist_ok=True)
        found = Host(name, namespace, address, outer, home)
        self.hosts[name] = found
        return found

    def __exit__(self, *_exc: object) -> None:
        for found in self.hosts.values():
            for process in found.processes:
                if process.poll() is None:
                    process.kill()
        for found in self.hosts.values():
            for process in found.processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)
            subprocess.run(["ip", "netns", "del", found.namespace], capture_output=True, timeout=30)
            subprocess.run(["ip", "link", "del", found.link], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        for folder in self.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        self._subnet_lock.close()  # the subnet is free once its bridge is gone


def wait_until(what: str, ready: object, timeout_s: float = 60.0, every_s: float = 0.2) -> None:
    """Poll ``ready()`` until it is true, or fail saying ``what`` did not happen."""
    until = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            if ready():  # type: ignore[operator]
                return
        except Exception as error:
            last = error
        if time.monotonic() > until:
            why = f" (last error: {type(last).__name__}: {last})" if last else ""
            raise AssertionError(f"{what} did not happen within {timeout_s:g} s{why}")
        time.sleep(every_s)


class Deployment:
    """Ferry over test hosts: Redis, PostgreSQL (its own initdb cluster), two API hosts, two
    sim-worker hosts and a Celery host (worker and beat), each in a namespace of its own."""

    def __init__(self, net: Network, python: str, **settings: str) -> None:
        self.net = net
        self.python = python
        self.redis = net.host("redis")
        self.postgres = net.host("postgres")
        self.apis = [net.host("api1"), net.host("api2")]
        self.workers = [net.host("worker1"), net.host("worker2")]
        self.celery = net.host("celery")
        self.redis_url = f"redis://{self.redis.address}:6379/0"
        self.database_url = f"postgresql+psycopg://postgres@{self.postgres.address}:5432/ferry"
        self.settings = settings
        self.worker_processes: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, host: Host) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        return base | {
            "FERRY_REDIS_URL": self.redis_url,
            "FERRY_DATABASE_URL": self.database_url,
            "FERRY_MODELS": "sim",
            "FERRY_DATA_DIR": str(host.home),
            "FERRY_METRICS_PORT_BASE": "0",
            **self.settings,
        }

    def start_redis(self) -> None:
        self.redis.spawn(
            [
                "redis-server",
                "--bind",
                self.redis.address,
                "--port",
                "6379",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            log="redis",
        )

    def start_postgres(self) -> None:
        # Its own folder: the postgres user must reach it, and test folders are root's alone.
        home = Path(tempfile.mkdtemp(prefix="ferry-pg-"))
        self.net.cleanup.append(home)
        home.chmod(0o755)
        data = home / "pgdata"
        data.mkdir()
        shutil.chown(data, "postgres")
        self.postgres.run(["initdb", "-D", str(data), "--auth=trust", "-U", "postgres"], "postgres")
        with (data / "pg_hba.conf").open("a") as hba:
            hba.write(f"host all all {self.net.subnet}.0/{PREFIX} trust\n")
        self.postgres.spawn(
            [
                "postgres",
                "-D",
                str(data),
                "-h",
                self.postgres.address,
                "-p",
                "5432",
                "-k",
                str(data),
                "-c",
                "fsync=off",
            ],
            user="postgres",
            log="postgres",
        )

    def start_api(self, host: Host) -> None:
        host.spawn(
            [self.python, "-m", "ferry", "api", "--host", host.address, "--port", "8000"],
            self.env(host),
            log="api",
        )

    def start_worker(self, host: Host) -> subprocess.Popen[bytes]:
        process = host.spawn(
            [self.python, "-m", "ferry", "worker", "--model", "sim", "--name", host.name],
            self.env(host),
            log="worker",
        )
        self.worker_processes[host.name] = process
        return process

    def start_celery(self) -> None:
        for role in ("worker", "beat"):
            self.celery.spawn(
                [self.python, "-m", "ferry", "celery", role], self.env(self.celery), log=role
            )

    def api_url(self, host: Host) -> str:
        return f"http://{host.address}:8000"
