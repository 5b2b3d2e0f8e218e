"""harness.ports: each pytest-xdist worker's ports come from a block no other worker uses."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import ports

ROOT = Path(__file__).resolve().parents[2]


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux)."""
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.fixture
def own_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Blocks claimed here are held in a folder of the test's own, and this worker's own
    block (its lock and its environment) is given back to it afterwards."""
    monkeypatch.setattr(ports, "LOCKS", tmp_path)
    monkeypatch.setattr(ports, "_held", None)
    monkeypatch.setattr(ports, "_next", {})
    for name in (ports.OWNER_ENV, ports.BLOCK_ENV, "PYTEST_XDIST_WORKER"):
        monkeypatch.setenv(name, "")  # restored afterwards, whatever claim_block sets
    yield tmp_path
    if ports._held is not None:
        ports._held.close()


def hold_block(locks: Path, worker: str) -> subprocess.Popen[str]:
    """Another process (another suite's worker named ``worker``) holding a block."""
    code = (
        "import sys; from harness import ports; from pathlib import Path; "
        f"ports.LOCKS = Path({str(locks)!r}); print(ports.claim_block(), flush=True); "
        "sys.stdin.read()"
    )
    env = {**os.environ, "PYTEST_XDIST_WORKER": worker, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    assert holder.stdout is not None
    holder.stdout.readline()
    return holder


def test_a_worker_claims_its_own_numbers_block_where_it_is_free(own_locks: Path) -> None:
    env = {"PYTEST_XDIST_WORKER": "gw7"}
    assert ports.claim_block(env) == 7
    assert env[ports.BLOCK_ENV] == "7" and env[ports.OWNER_ENV] == str(os.getpid())
    assert ports.block_index(env) == 7
    assert ports.block_index({}) is None
    assert ports.block_index({"PYTEST_XDIST_WORKER": "gw7"}) is None  # no block claimed


def test_a_block_another_suite_s_worker_holds_is_passed_over_until_it_ends(
    own_locks: Path,
) -> None:
    holder = hold_block(own_locks, "gw3")
    try:
        assert ports.claim_block({"PYTEST_XDIST_WORKER": "gw3"}) == 4
    finally:
        holder.communicate("", timeout=30)
    # Its process gone, its lock is free again (the one this process holds is let go too).
    assert ports.claim_block({"PYTEST_XDIST_WORKER": "gw3"}) == 3
    assert ports.claim_block({"PYTEST_XDIST_WORKER": "gw4"}) == 4


def test_a_process_the_worker_started_has_no_block_of_its_own() -> None:
    # It inherited the worker's environment: the block is the worker's, by its pid.
    inherited = {ports.OWNER_ENV: str(os.getppid()), ports.BLOCK_ENV: "1"}
    assert ports.block_index(inherited) is None


def test_the_blocks_stay_below_the_kernel_s_ephemeral_range() -> None:
    last = ports.BLOCKS_START + ports.MAX_WORKERS * ports.BLOCK_PORTS - 1
    low = ephemeral_low()
    assert last < low


def test_workers_get_ports_of_their_own_ten_apart(
    own_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    assert ports.claim_block() == 2
    first, second = ports.free_port(), ports.free_port()
    start = ports.BLOCKS_START + 2 * ports.BLOCK_PORTS
    assert start <= first < second < start + ports.BLOCK_PORTS
    # The nine between are a stack's metrics ports; a port something else listens on is
    # passed over a whole stride at a time.
    assert (second - first) % ports.STRIDE == 0
    monkeypatch.setenv(ports.BLOCK_ENV, "3")
    assert ports.free_port() >= start + ports.BLOCK_PORTS


def test_a_port_something_listens_on_is_passed_over(
    own_locks: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ports.OWNER_ENV, str(os.getpid()))
    monkeypatch.setenv(ports.BLOCK_ENV, "4")
    start = ports.BLOCKS_START + 4 * ports.BLOCK_PORTS
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", start))
        held.listen()
        assert ports.free_port() == start + ports.STRIDE


def test_outside_pytest_xdist_the_kernel_picks(own_locks: Path) -> None:
    low = ephemeral_low()
    assert ports.free_port() >= low
