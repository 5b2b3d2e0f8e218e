"""harness.netns: two networks alive at once never share a subnet (their bridges would
route each other's packets), and a network's subnet is free again once it is gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import netns


@pytest.fixture(autouse=True)
def own_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "LOCKS", tmp_path / "locks")


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
