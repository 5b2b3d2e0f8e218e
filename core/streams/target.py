"""How every part reaches Ferry's Redis: one URL, the primary that Sentinel names, or a
Redis Cluster.

With ``FERRY_REDIS_SENTINELS`` set, clients ask the sentinels for the primary
of ``FERRY_REDIS_SENTINEL_SERVICE`` and ask again when a connection to it
fails, so after a failover they follow the promoted replica by themselves.
With ``FERRY_REDIS_CLUSTER`` set, ``FERRY_REDIS_URL`` names one node; clients
learn the slots from it and follow MOVED and ASK replies as slots move.
Each kind of client Ferry uses is made here, so none can miss the setting:
redis-py (sync and asyncio), Celery's broker (kombu's ``sentinel://``, or
``FERRY_CELERY_BROKER_URL``), and the rate limiter's storage (``limits``'
``redis+sentinel`` and ``redis+cluster``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, TypeGuard, cast
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline as AsyncClusterPipeline
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import RedisClusterException
from redis.sentinel import Sentinel

# What a Redis that fails raises: redis-py's errors, and the Cluster client's own (not
# one of them) when no node serves a key's slot or none can be reached.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)


# How often a ServerClock reads the Redis server's clock again.
SERVER_CLOCK_RESYNC_S = 10.0
# A reading whose round trip is this short is taken at once; a longer one is tried again,
# up to SERVER_CLOCK_READINGS times in all, and the shortest kept.
SERVER_CLOCK_PRECISE_S = 0.002
SERVER_CLOCK_READINGS = 3


class ServerClock:
    """The wall-clock time by the Redis server's clock (``TIME``), carried between readings
    by this host's monotonic clock: the clock of the workers (deadlines, claims, the times
    they record, their heartbeats), of webhook deliveries (their schedule, leases and
    signatures' timestamps) and of the API's submissions (a job's ``created_at`` and the
    ``deadline_at`` it promises).

    A deadline is a time on the clock of the system, not of the host that meets it: a
    worker whose host's clock was stepped (an NTP step, a VM resumed) would expire jobs
    that are not late, or run late ones, and write start and end times off by the step;
    a Celery worker's would sign deliveries receivers refuse as too new or too old.
    Read again every ``resync_s``; while Redis cannot answer, the last reading carries
    on (this host's wall clock until the first).
    """

    def __init__(self, client: redis.Redis, resync_s: float = SERVER_CLOCK_RESYNC_S) -> None:
        self.client = client
        self.resync_s = resync_s
        self._offset: float | None = None  # the server's time less this host's monotonic
        self._read_at = float("-inf")

    def __call__(self) -> float:
        if time.monotonic() - self._read_at >= self.resync_s:
            self._read()
        return self.cached()

    def cached(self) -> float:
        """The time by the last reading, never asking Redis (this host's wall clock until the
        first): for a caller that must not wait on Redis, which calls :meth:`resync` on a
        schedule of its own."""
        if self._offset is None:
            return time.time()
        return time.monotonic() + self._offset

    def resync(self) -> None:
        """Read the server's clock now."""
        self._read()

    def _read(self) -> None:
        """Take the offset from the reading with the shortest round trip of up to
        ``SERVER_CLOCK_READINGS``: the server's time is placed at the round trip's midpoint,
        so a reading is off by up to half of it, and the first on a fresh connection also
        waits for the connection to be made (hundreds of ms on a loaded host, enough to put
        a job's first token before its creation on another process's clock)."""
        self._read_at = time.monotonic()  # a failed reading waits resync_s too
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(SERVER_CLOCK_READINGS):
            try:
                before = time.monotonic()
                reply: Any = self.client.time()
                after = time.monotonic()
            except REDIS_ERRORS:
                break
            if isinstance(reply, dict):  # a cluster client's: one node's
                reply = next(iter(reply.values()))
            seconds, micros = reply
            offset = seconds + micros / 1e6 - (before + after) / 2
            if best is None or after - before < best[0]:
                best = (after - before, offset)
            if after - before <= SERVER_CLOCK_PRECISE_S:
                break
        if best is not None:
            self._offset = best[1]


@dataclass(frozen=True)
class RedisSettings:
    """Where a process finds Redis (``Settings.section``): FERRY_REDIS_URL or the sentinels
    and their service, whether it is a Cluster, and Celery's broker where it is not Redis."""

    redis_url: str | None
    redis_sentinels: list[str]
    redis_sentinel_service: str
    redis_cluster: bool
    celery_broker_url: str | None


@dataclass(frozen=True)
class RedisTarget:
    url: str | None
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = "ferry"
    cluster: bool = False
    broker_url: str | None = None  # Celery's, when it is not this Redis

    @classmethod
    def of(cls, redis: RedisSettings) -> RedisTarget:
        if not (redis.redis_url or redis.redis_sentinels):
            raise ValueError(
                "FERRY_REDIS_URL (or FERRY_REDIS_SENTINELS) is not set (`ferry up` sets it)"
            )
        sentinels = tuple(
            (host, int(port))
            for host, _, port in (address.rpartition(":") for address in redis.redis_sentinels)
        )
        return cls(
            redis.redis_url,
            sentinels,
            redis.redis_sentinel_service,
            redis.redis_cluster,
            redis.celery_broker_url,
        )

    @property
    def uses_sentinel(self) -> bool:
        return bool(self.sentinels)

    def _auth(self) -> dict[str, Any]:
        """The URL's credentials and database, for connections to the primary."""
        if not self.url:
            return {}
        parts = urlsplit(self.url)
        found: dict[str, Any] = {}
        if parts.username:
            found["username"] = unquote(parts.username)
        if parts.password:
            found["password"] = unquote(parts.password)
        database = parts.path.lstrip("/")
        if database.isdigit():
            found["db"] = int(database)
        return found

    def client(self, **options: Any) -> redis.Redis:
        """A redis-py client (``options``: decode_responses, timeouts, ...)."""
        # A cluster client is not a redis.Redis, but it has every command Ferry sends (see
        # ``is_cluster`` for the few that differ).
        return cast(redis.Redis, self._client(RedisCluster, redis.Redis, Sentinel, options))

    def async_client(self, **options: Any) -> aioredis.Redis:
        """An asyncio redis-py client."""
        return cast(
            aioredis.Redis,
            self._client(AsyncRedisCluster, aioredis.Redis, AsyncSentinel, options),
        )

    def _client(self, cluster: Any, plain: Any, sentinel: Any, options: dict[str, Any]) -> Any:
        """The target's client, from ``cluster``, ``plain`` or ``sentinel``: redis-py's
        blocking classes or its asyncio ones."""
        if self.cluster:
            assert self.url is not None
            return cluster.from_url(self.url, **options)
        if not self.sentinels:
            assert self.url is not None
            return plain.from_url(self.url, **options)
        sentinels = sentinel(
            list(self.sentinels),
            socket_timeout=options.get("socket_timeout", 2.0),
            socket_connect_timeout=options.get("socket_connect_timeout", 2.0),
        )
        return sentinels.master_for(self.service, **(self._auth() | options))

    def broker(self) -> tuple[str, dict[str, Any]]:
        """Celery's broker URL and the transport options it needs."""
        if self.broker_url:
            return self.broker_url, {}
        if self.cluster:
            raise ValueError(
                "FERRY_CELERY_BROKER_URL is not set: Celery cannot use a Redis Cluster"
            )
        if not self.sentinels:
            assert self.url is not None
            return self.url, {}
        auth = self._auth()
        credentials = ""
        if "password" in auth:
            # kombu splits the URLs on ';' and each at '@' and ':': quoted, they stay whole.
            user = quote(auth.get("username", ""), safe="")
            credentials = f"{user}:{quote(auth['password'], safe='')}@"
        url = ";".join(
            f"sentinel://{credentials}{host}:{port}/{auth.get('db', 0)}"
            for host, port in self.sentinels
        )
        return url, {"master_name": self.service}

    def limits_uri(self) -> tuple[str, dict[str, Any]]:
        """The rate limiter's storage URI (asyncio) and the options it needs."""
        if self.cluster:
            assert self.url is not None
            parts = urlsplit(self.url)
            credentials = parts.netloc.rpartition("@")[0]
            at = f"{credentials}@" if credentials else ""
            return f"async+redis+cluster://{at}{parts.hostname}:{parts.port or 6379}", {}
        if not self.sentinels:
            assert self.url is not None
            return f"async+{self.url}", {}
        hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
        # Counts read from a replica would lag: every read goes to the primary.
        return f"async+redis+sentinel://{hosts}/{self.service}", {
            "use_replicas": False,
            # The sentinels' own connections: a silent sentinel must cost little.
            "sentinel_kwargs": {"socket_timeout": 0.25, "socket_connect_timeout": 0.25},
            **self._auth(),
        }

    def describe(self) -> str:
        """Where it points, without secrets (for logs and errors)."""
        if self.sentinels:
            hosts = ",".join(f"{host}:{port}" for host, port in self.sentinels)
            return f"sentinel {self.service} via {hosts}"
        parts = urlsplit(self.url or "")
        where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}"
        return f"cluster via {where}" if self.cluster else where


def is_cluster(client: object) -> bool:
    """Whether ``client`` (a client or a pipeline) talks to a Redis Cluster. There a pipeline
    refuses EVALSHA and PUBLISH, and an asyncio client must learn the slots before it
    subscribes."""
    return isinstance(
        client, RedisCluster | ClusterPipeline | AsyncRedisCluster | AsyncClusterPipeline
    )


def is_pipeline(client: object) -> TypeGuard[ClusterPipeline]:
    """Whether ``client`` is a Redis Cluster pipeline (where a command may name its node)."""
    return isinstance(client, ClusterPipeline)
