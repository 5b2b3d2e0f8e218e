"""harness.ports: each pytest-xdist worker's ports come from a block no other worker uses."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from harness import ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux)."""
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def worker(name: str, owner: int | None = None) -> dict[str, str]:
    return {"PYTEST_XDIST_WORKER": name, ports.OWNER_ENV: str(owner or os.getpid())}


def test_the_worker_index_is_read_from_pytest_xdist_s_name() -> None:
    assert ports.worker_index(worker("gw0")) == 0
    assert ports.worker_index(worker("gw7")) == 7
    assert ports.worker_index({}) is None
    assert ports.worker_index(worker("master")) is None


def test_a_process_the_worker_started_has_no_block_of_its_own() -> None:
    # It inherited the worker's environment: the block is the worker's, by its pid.
    assert ports.worker_index(worker("gw1", owner=os.getppid())) is None
    assert ports.worker_index({"PYTEST_XDIST_WORKER": "gw1"}) is None


def test_the_blocks_stay_below_the_kernel_s_ephemeral_range() -> None:
    last = ports.BLOCKS_START + ports.MAX_WORKERS * ports.BLOCK_PORTS - 1
    low = ephemeral_low()
    assert last < low


def test_workers_get_ports_of_their_own_ten_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_next", {})
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv(ports.OWNER_ENV, "0")  # restored afterwards, whatever claim_block sets
    ports.claim_block()
    first, second = ports.free_port(), ports.free_port()
    start = ports.BLOCKS_START + 2 * ports.BLOCK_PORTS
    assert start <= first < second < start + ports.BLOCK_PORTS
    # The nine between are a stack's metrics ports; a port something else listens on is
    # passed over a whole stride at a time (another suite on the machine may hold gw2's).
    assert (second - first) % ports.STRIDE == 0
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert ports.free_port() >= start + ports.BLOCK_PORTS


def test_a_port_something_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw4")
    monkeypatch.setenv(ports.OWNER_ENV, str(os.getpid()))
    monkeypatch.setattr(ports, "_next", {})
    start = ports.BLOCKS_START + 4 * ports.BLOCK_PORTS
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", start))
        held.listen()
        assert ports.free_port() == start + ports.STRIDE


def test_outside_pytest_xdist_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    low = ephemeral_low()
    assert ports.free_port() >= low
