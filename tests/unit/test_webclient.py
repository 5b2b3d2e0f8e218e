"""harness.webclient: the suite's HTTP clients share one TLS context per process."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from harness import webclient

ROOT = Path(__file__).resolve().parents[2]
# What makes an httpx client with a TLS context of its own at every call.
CONTEXT_PER_CALL = re.compile(r"\bhttpx\.(get|post|put|patch|delete|head|request|Client)\(")


def test_every_client_shares_the_one_context() -> None:
    first, second = webclient.client(), webclient.client(base_url="http://127.0.0.1:9")
    try:
        assert webclient.tls() is webclient.tls()
        for made in (first, second):
            assert made._transport._pool._ssl_context is webclient.tls()  # type: ignore[attr-defined]
    finally:
        first.close()
        second.close()


def test_a_request_goes_through_and_its_errors_are_httpxs() -> None:
    try:
        webclient.get("http://127.0.0.1:9/readyz", timeout=1)  # the discard port: nothing there
    except httpx.ConnectError:
        pass
    else:
        raise AssertionError("a request to a closed port answered")


def test_the_suite_makes_no_client_of_its_own_context() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("tests", "harness", "bench")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name != "webclient.py" and path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CONTEXT_PER_CALL.search(line)
    ]
    assert not offenders, "use harness.webclient:\n" + "\n".join(offenders)
