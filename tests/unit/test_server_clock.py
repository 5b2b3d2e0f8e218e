"""core.streams.target.ServerClock: the Redis server's time, read now and then, carried between
readings by the monotonic clock; ``cached`` never asks Redis."""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis

from core.streams.target import ServerClock


class Server:
    """A Redis client's TIME, answering a clock 1,000 s ahead of this host's (or failing)."""

    def __init__(self) -> None:
        self.calls = 0
        self.down = False

    def time(self) -> tuple[int, int]:
        self.calls += 1
        if self.down:
            raise redis.ConnectionError("gone")
        ahead = time.time() + 1000.0
        return int(ahead), int((ahead % 1) * 1e6)


def clock(server: Server, resync_s: float = 10.0) -> ServerClock:
    client: Any = server
    return ServerClock(client, resync_s)


def test_cached_never_asks_redis_and_reads_the_last_reading() -> None:
    server = Server()
    c = clock(server)
    assert c.cached() == pytest.approx(time.time(), abs=0.5)  # no reading yet: the host's
    assert server.calls == 0
    c.resync()
    assert server.calls == 1
    assert c.cached() == pytest.approx(time.time() + 1000.0, abs=0.5)
    assert server.calls == 1


def test_calling_it_reads_again_after_resync_s_and_a_failed_reading_keeps_the_last() -> None:
    server = Server()
    c = clock(server, resync_s=0.05)
    assert c() == pytest.approx(time.time() + 1000.0, abs=0.5)
    assert c() == pytest.approx(time.time() + 1000.0, abs=0.5) and server.calls == 1
    time.sleep(0.06)
    server.down = True
    assert c() == pytest.approx(time.time() + 1000.0, abs=0.5)  # carried on
    assert server.calls == 2


class SlowFirst(Server):
    """A TIME whose first call waits before the server reads its clock, as a fresh
    connection's does while it is made: the server's time then lies near the end of that
    round trip, not at its midpoint."""

    def __init__(self, wait_s: float) -> None:
        super().__init__()
        self.wait_s = wait_s

    def time(self) -> tuple[int, int]:
        if self.calls == 0:
            time.sleep(self.wait_s)
        return super().time()


def test_a_reading_slowed_by_its_connection_is_read_again_and_the_shortest_round_trip_kept() -> (
    None
):
    server = SlowFirst(wait_s=0.4)
    c = clock(server)
    c.resync()
    assert server.calls == 2
    # Off by 0.2 s (half the slow round trip) had the first reading been kept.
    assert c.cached() - time.time() == pytest.approx(1000.0, abs=0.05)


def test_readings_that_stay_slow_keep_the_shortest_and_stop_after_three() -> None:
    class Slow(Server):
        def time(self) -> tuple[int, int]:
            time.sleep(0.01)
            return super().time()

    server = Slow()
    c = clock(server)
    c.resync()
    assert server.calls == 3
    assert c.cached() - time.time() == pytest.approx(1000.0, abs=0.05)
