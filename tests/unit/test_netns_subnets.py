"""harness.netns: two networks alive at once never share a subnet (their bridges would
route each other's packets), a network's subnet is free again once it is gone, and a
subnet still held by a dead network's bridge is cleared (or skipped, if not a test
network's). The interfaces are stood in for here; tests/multihost has a real stale one."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness import netns


@dataclass
class Machine:
    """A stand-in for the machine's interfaces: the real ones may hold a running test
    network's bridge, which these tests must never remove."""

    interfaces: dict[str, list[str]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)


@pytest.fixture(autouse=True)
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Machine:
    found = Machine()
    monkeypatch.setattr(netns, "LOCKS", tmp_path / "locks")
    monkeypatch.setattr(netns, "interfaces_in", lambda subnet: found.interfaces.get(subnet, []))
    monkeypatch.setattr(netns, "remove_stale_network", found.removed.append)
    return found


def test_networks_alive_at_once_take_different_subnets() -> None:
    first, first_lock = netns.claim_subnet()
    second, second_lock = netns.claim_subnet()
    try:
        assert first == "198.18.0" and second == "198.18.1"
    finally:
        first_lock.close()
        second_lock.close()


def test_a_subnet_is_free_again_when_its_holder_lets_go() -> None:
    first, first_lock = netns.claim_subnet()
    first_lock.close()
    again, again_lock = netns.claim_subnet()
    again_lock.close()
    assert again == first


def test_with_every_subnet_taken_there_is_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "SUBNETS", 2)
    held = [netns.claim_subnet()[1] for _ in range(2)]
    try:
        with pytest.raises(netns.ServiceMissing, match="test subnets"):
            netns.claim_subnet()
    finally:
        for lock in held:
            lock.close()


def test_a_dead_networks_bridge_on_a_free_subnet_is_removed_and_the_subnet_taken(
    machine: Machine,
) -> None:
    machine.interfaces["198.18.0"] = ["fbrdead"]
    subnet, lock = netns.claim_subnet()
    lock.close()
    assert subnet == "198.18.0"
    assert machine.removed == ["fbrdead"]


def test_a_subnet_another_interface_holds_is_skipped(machine: Machine) -> None:
    machine.interfaces["198.18.0"] = ["eth1"]
    subnet, lock = netns.claim_subnet()
    lock.close()
    assert subnet == "198.18.1"
    assert machine.removed == []
