"""Redis Cluster, for tests and benchmarks: three primaries, each a ``redis-server`` of its own
with ``cluster-enabled`` on a free loopback port, its slots assigned in three even ranges,
stopped afterwards; and a slot moved from one primary to another while clients use it.

The cluster is built and resharded with the commands ``redis-cli --cluster create`` and
``redis-cli --cluster reshard`` send (CLUSTER MEET, ADDSLOTS, SETSLOT, MIGRATE), issued
here so that each step can be watched and a slot moved in the middle of a load.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import key_slot
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Job, make_engine, make_sessionmaker
from core.streams.protocol import stream_key
from harness import webclient
from harness.ports import bindable, free_port
from harness.served import served
from harness.services import redis_server, redis_started, stop_all
from harness.settling import reconciling, settled
from harness.worker import running_worker

SLOTS = 16384
NODE_TIMEOUT_MS = 2000
MIGRATE_BATCH = 100
BUS_OFFSET = 10000
SIM_MODEL = Path(__file__).resolve().parent.parent / "models" / "sim"


def _port_with_bus() -> int:
    """A free port whose cluster bus port (10,000 above it, as Redis before 7 requires) is
    free too."""
    for _ in range(100):
        port = free_port()
        if port + BUS_OFFSET <= 65535 and bindable(port + BUS_OFFSET):
            return port
    raise AssertionError("no free pair of ports for a cluster node")


class ClusterRedis:
    """``with ClusterRedis(tmp) as cluster:`` then ``cluster.url`` for FERRY_REDIS_URL."""

    def __init__(self, tmp: Path, primaries: int = 3) -> None:
        self.tmp = tmp
        self.program = redis_server()
        self.primaries = primaries
        self.ports: list[int] = []  # the nodes', once started
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self._nodes: dict[int, redis.Redis] = {}

    @property
    def url(self) -> str:
        """Any node's URL: clients learn the rest of the cluster from it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node(self, port: int) -> redis.Redis:
        """A client of the node on ``port`` alone (made once, closed with the cluster)."""
        if port not in self._nodes:
            self._nodes[port] = redis.Redis(port=port, socket_timeout=5, decode_responses=True)
        return self._nodes[port]

    def _start(self) -> int:
        """A node on a port of its own (its bus port free too), answering; its port."""
        lines = [
            "cluster-enabled yes",
            "cluster-config-file nodes.conf",
            f"cluster-node-timeout {NODE_TIMEOUT_MS}",
        ]
        port, process = redis_started(self.program, self.tmp, lines, port=_port_with_bus)
        self.processes[port] = process
        return port

    def __enter__(self) -> ClusterRedis:
        try:
            self.ports = [self._start() for _ in range(self.primaries)]
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self, timeout_s: float = 30.0) -> None:
        until = time.monotonic() + timeout_s
        share = SLOTS // len(self.ports)
        for n, port in enumerate(self.ports):
            last = SLOTS - 1 if n == len(self.ports) - 1 else (n + 1) * share - 1
            self.node(port).execute_command("CLUSTER ADDSLOTS", *range(n * share, last + 1))
        for port in self.ports[1:]:
            self.node(port).execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
        while not all(self._ready(port) for port in self.ports):
            if time.monotonic() > until:
                raise AssertionError("the Redis Cluster did not come up")
            time.sleep(0.1)

    def _ready(self, port: int) -> bool:
        info = self.node(port).execute_command("CLUSTER INFO")
        return bool(
            info.get("cluster_state") == "ok"
            and int(info.get("cluster_known_nodes", 0)) == len(self.ports)
        )

    def node_id(self, port: int) -> str:
        return str(self.node(port).execute_command("CLUSTER MYID"))

    def owner(self, key: str) -> int:
        """The port of the primary that holds ``key``'s slot."""
        return self._served_by(key_slot(key.encode()))[0]

    def _served_by(self, slot: int) -> tuple[int, str]:
        """The port and node id of the primary that serves ``slot``."""
        for low, high, *nodes in self.node(self.ports[0]).execute_command("CLUSTER SLOTS"):
            if low <= slot <= high:
                return int(nodes[0][1]), str(nodes[0][2])
        raise AssertionError(f"slot {slot} is not served")

    def move_slot(
        self, slot: int, to: int, pause_s: float = 0.0, batch: int = MIGRATE_BATCH
    ) -> int:
        """Migrate ``slot`` to the primary on port ``to`` as ``redis-cli --cluster reshard``
        does, ``batch`` keys at a time (``pause_s`` between batches, so clients see the slot
        half moved: ASK replies, and TRYAGAIN for commands whose keys are on both sides);
        the number of keys moved."""
        source, source_id = self._served_by(slot)
        if source == to:
            return 0
        src, dst = self.node(source), self.node(to)
        dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", source_id)
        src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(to))
        moved = 0
        while keys := src.execute_command("CLUSTER GETKEYSINSLOT", slot, batch):
            src.execute_command("MIGRATE", "127.0.0.1", to, "", 0, 5000, "KEYS", *keys)
            moved += len(keys)
            time.sleep(pause_s)
        for port in (to, source, *[p for p in self.ports if p not in (to, source)]):
            self.node(port).execute_command("CLUSTER SETSLOT", slot, "NODE", self.node_id(to))
        return moved

    def __exit__(self, *_exc: object) -> None:
        for client in self._nodes.values():
            client.close()
        stop_all(self.processes.values())


def models_on_every_shard(cluster: ClusterRedis, prefix: str) -> list[str]:
    """Names for sim models whose keys land one on each primary (the hash tag is the name)."""
    chosen: dict[int, str] = {}
    for n in range(10_000):
        name = f"sim-{n}"
        chosen.setdefault(cluster.owner(stream_key(prefix, name, "batch")), name)
        if len(chosen) == len(cluster.ports):
            return [chosen[port] for port in cluster.ports]
    raise AssertionError("no names found for every shard")


def sim_repository(root: Path, names: list[str]) -> Path:
    """A model repository holding the shipped sim model under each of ``names``."""
    for name in names:
        shutil.copytree(SIM_MODEL, root / name)
        toml = root / name / "model.toml"
        toml.write_text(toml.read_text().replace('name = "sim"', f'name = "{name}"', 1))
    return root


@dataclass(frozen=True)
class Resharding:
    """What moving a model's slot under load did to the jobs."""

    sent: int
    accepted: dict[str, list[str]]  # each model's accepted job ids
    refused: list[int]  # the status codes of the submissions refused
    moved_keys: int  # keys the migration moved
    before: dict[str, int]  # each model's primary (port) before the move
    after: dict[str, int]  # and after it
    jobs: dict[str, Job]  # the accepted jobs' rows at the end


def reshard_under_load(
    cluster: ClusterRedis,
    settings: Settings,
    models: list[str],
    *,
    load_s: float = 12.0,
    move_at_s: float = 3.0,
    rate: float = 30.0,
    settle_s: float = 60.0,
) -> Resharding:
    """Submit sim jobs of ``models`` in turn at ``rate`` for ``load_s`` through the API
    (uvicorn, this process), a sim worker per model and the reconciler running as beat runs
    it; at ``move_at_s`` move the first model's slot to the next primary, a key at a time;
    then wait up to ``settle_s`` for every accepted job to finish."""
    engine = make_engine(settings.sqlalchemy_url)
    sessions: sessionmaker[Session] = make_sessionmaker(engine)
    with sessions() as session:
        token = create_key(session, "resharding").token
    before = {
        model: cluster.owner(stream_key(settings.key_prefix, model, "batch")) for model in models
    }
    moving = models[0]
    slot = key_slot(stream_key(settings.key_prefix, moving, "batch").encode())
    destination = cluster.ports[(cluster.ports.index(before[moving]) + 1) % len(cluster.ports)]
    accepted: dict[str, list[str]] = {model: [] for model in models}
    refused: list[int] = []
    moved: list[int] = []

    def mover() -> None:
        moved.append(cluster.move_slot(slot, destination, pause_s=0.2, batch=1))

    moving_thread = threading.Thread(target=mover, daemon=True)
    sent = 0
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(served(settings))
        for model in models:
            stack.enter_context(running_worker(settings, model, f"{model}-worker"))
        stack.enter_context(reconciling(settings))
        started = time.monotonic()
        with webclient.client(
            base_url=api.base, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as client:
            while (elapsed := time.monotonic() - started) < load_s:
                if moving_thread.ident is None and elapsed >= move_at_s:  # not started yet
                    moving_thread.start()
                if sent >= elapsed * rate:
                    time.sleep(0.005)
                    continue
                model = models[sent % len(models)]
                sent += 1
                answer = client.post("/v1/jobs", json={"model": model, "input": {"cost": 2}})
                if answer.status_code == 202:
                    accepted[model].append(answer.json()["id"])
                else:
                    refused.append(answer.status_code)
        moving_thread.join(timeout=60)
        jobs = settled(
            sessions, [job_id for each in accepted.values() for job_id in each], settle_s
        )
    engine.dispose()
    after = {
        model: cluster.owner(stream_key(settings.key_prefix, model, "batch")) for model in models
    }
    return Resharding(sent, accepted, refused, sum(moved), before, after, jobs)
