"""The SSRF guard through the system's own resolver: glibc's getaddrinfo asking a DNS
server this test runs, in a network namespace whose /etc/resolv.conf names it (``ip
netns exec`` mounts /etc/netns/NAME/resolv.conf over it). The check and the POST run as
a process inside the namespace, as a webhook attempt runs them. Root only: skipped with
the reason elsewhere, required under CI=true."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.netns import Host, Network, wait_until
from harness.services import ServiceMissing
from tests.dns_server import read_log

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PORT = 8080  # the namespace's own: nothing else listens there
PUBLIC = "93.184.216.34"
# A private address that exists on the namespace's loopback only; its /24 for the allow-list.
PRIVATE = f"10.{(os.getpid() >> 8) & 0xFF}.{os.getpid() & 0xFF}.7"
PRIVATE_NET = PRIVATE.rsplit(".", 1)[0] + ".0/24"
INTRANET = "hooks.example-tenant.test"  # a public-looking name with a private answer
REBINDING = "rebind.example-tenant.test"  # public at first, 127.0.0.1 after
ZONE = {INTRANET: [[PRIVATE]], REBINDING: [[PUBLIC], ["127.0.0.1"]]}


@dataclass
class Namespace:
    host: Host
    dns_log: Path
    receiver_log: Path

    def run(self, *args: str) -> object:
        completed = subprocess.run(
            ["ip", "netns", "exec", self.host.namespace, sys.executable, "-m", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        return json.loads(completed.stdout.strip().splitlines()[-1])

    def deliver(self, url: str, *allowed: str) -> dict[str, object]:
        flags = [arg for network in allowed for arg in ("--allow", network)]
        result = self.run("tests.ssrf_probe", "deliver", url, *flags)
        assert isinstance(result, dict)
        return result

    def queries(self, name: str, qtype: str = "A") -> list[object]:
        """The answers the DNS server gave to ``qtype`` queries for ``name``, in order."""
        log = read_log(self.dns_log)
        return [q["answer"] for q in log if q.get("name") == name and q.get("type") == qtype]

    def received(self) -> list[dict[str, str]]:
        if not self.receiver_log.exists():
            return []
        return [json.loads(line) for line in self.receiver_log.read_text().splitlines()]


def _ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        raise ServiceMissing(f"ip {' '.join(args)} failed: {exc.stderr.strip()}") from None


@pytest.fixture
def namespace(tmp_path: Path) -> Iterator[Namespace]:
    with Network(tmp_path) as net:
        try:
            host = net.host("dns")
        except subprocess.CalledProcessError as exc:
            raise ServiceMissing(f"network namespaces are not usable here: {exc.stderr}") from None
        etc = Path("/etc/netns") / host.namespace
        try:
            etc.mkdir(parents=True)
            # Only the test's server answers, and only DNS (not a hosts file) names these.
            (etc / "resolv.conf").write_text(
                f"nameserver {host.address}\noptions timeout:2 attempts:2\n"
            )
            (etc / "nsswitch.conf").write_text("hosts: files dns\n")
            (etc / "hosts").write_text("127.0.0.1 localhost\n")
            for address in (PUBLIC, PRIVATE):
                _ip("-n", host.namespace, "addr", "add", f"{address}/32", "dev", "lo")
            found = Namespace(host, host.home / "queries.jsonl", host.home / "received.jsonl")
            python = [sys.executable, "-m"]
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            host.spawn(
                [*python, "tests.dns_server", "--listen", host.address,
                 "--zone", json.dumps(ZONE), "--log", str(found.dns_log)],
                env, log="dns",
            )  # fmt: skip
            host.spawn(
                [*python, "tests.ssrf_probe", "receive", "--port", str(PORT),
                 "--log", str(found.receiver_log)],
                env, log="receiver",
            )  # fmt: skip
            for name in ("dns", "receiver"):
                wait_until(f"the {name} to listen", lambda n=name: "ready" in host.log(n), 30)
            yield found
        finally:
            shutil.rmtree(etc, ignore_errors=True)


def test_a_public_looking_name_with_a_private_answer_is_refused(namespace: Namespace) -> None:
    result = namespace.deliver(f"http://{INTRANET}:{PORT}/hook")
    assert result == {
        "refused": f"{INTRANET} resolves to {PRIVATE}, a private address",
        "permanent": True,
    }
    assert namespace.queries(INTRANET) == [[PRIVATE]]  # the answer came from the test's DNS
    assert namespace.received() == []


def test_the_allow_list_lets_the_private_answer_through_to_the_receiver(
    namespace: Namespace,
) -> None:
    result = namespace.deliver(f"http://{INTRANET}:{PORT}/hook", PRIVATE_NET)
    assert result == {"addresses": [PRIVATE], "status": 204}
    assert namespace.received() == [
        {"local": PRIVATE, "host": f"{INTRANET}:{PORT}", "path": "/hook"}
    ]


def test_a_rebinding_name_is_called_at_the_checked_address_not_the_rebound_one(
    namespace: Namespace,
) -> None:
    result = namespace.deliver(f"http://{REBINDING}:{PORT}/hook")
    assert result == {"addresses": [PUBLIC], "status": 204}
    received = namespace.received()
    assert [r["local"] for r in received] == [PUBLIC], received
    # One A query, the check's: the POST went to the pinned address without asking again.
    assert namespace.queries(REBINDING) == [[PUBLIC]]
    # The trap was live: asked again now, the name leads to 127.0.0.1, where the
    # receiver listens too.
    assert namespace.run("tests.ssrf_probe", "resolve", REBINDING) == ["127.0.0.1"]
    assert namespace.queries(REBINDING) == [[PUBLIC], ["127.0.0.1"]]
    assert all(r["local"] != "127.0.0.1" for r in namespace.received())
