"""Flower's memory is bounded: `ferry up` starts it with FERRY_FLOWER_MAX_TASKS, and once more
batches have run than that, Flower holds only that many tasks while its counters count them all.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import webclient
from harness.processes import wait_for
from harness.stack import FerryUp

pytestmark = pytest.mark.e2e

BOUND = 10
BATCHES = 2 * BOUND + 5
# Events travel best effort (Redis pub/sub; a worker drops what it cannot send, and counts
# it): the newest BOUND tasks Flower holds must have come after this many batches were
# sent, which leaves room for a few lost on the way.
HALFWAY = BATCHES - BOUND - 5


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FerryUp]:
    stack = FerryUp(
        tmp_path_factory.mktemp("flower-bound"), FERRY_MODELS="sim",
        FERRY_FLOWER_MAX_TASKS=str(BOUND),
    )  # fmt: skip
    with stack.running():
        yield stack


def _counted(page: str, name: str, **labels: str) -> int:
    """The sum of the samples of ``name`` with ``labels`` on a Prometheus page."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(page)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )
    )


def _batches_seen(url: str, auth: tuple[str, str]) -> int:
    """The sim batches Flower has heard end, from its own counter (which no bound trims)."""
    page = webclient.get(f"{url}/metrics", auth=auth, timeout=10).text
    return _counted(page, "flower_events_total", task="ferry.batch.sim", type="task-succeeded")


def _hears_events(url: str, auth: tuple[str, str]) -> bool:
    try:
        page = webclient.get(f"{url}/metrics", auth=auth, timeout=10)
    except httpx.TransportError:
        return False  # Flower still starting
    return page.status_code == 200 and _counted(page.text, "flower_events_total") > 0


def _worker_dropped(stack: FerryUp) -> int:
    """The Celery events the sim worker could not send (``ferry up`` gives the models the
    first metrics ports)."""
    port = int(stack.env["FERRY_METRICS_PORT_BASE"])
    page = webclient.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return _counted(page, "ferry_worker_events_dropped_total")


def test_flower_holds_at_most_its_bound_of_tasks(stack: FerryUp) -> None:
    banner = "".join(stack.output)
    match = re.search(r"Flower\s+(\S+)\s+\(user (\S+), password (\S+)\)", banner)
    assert match, banner[-2000:]
    url, user, password = match.groups()
    auth = (user, password)
    headers = {"Authorization": f"Bearer {stack.token}"}

    # Events sent before Flower listens are heard by no one (pub/sub): the batches start
    # once it has heard its first event (a Celery worker's heartbeat, every 2 s).
    wait_for("Flower to hear an event", functools.partial(_hears_events, url, auth), 120)

    # One job at a time, each waited for: every job is a batch of its own, so a task.
    halfway = 0.0
    for sent in range(BATCHES):
        if sent == HALFWAY:
            halfway = time.time()  # BOUND and more tasks are received after this
        response = webclient.post(
            f"{stack.base}/v1/jobs", json={"model": "sim", "input": {"cost": 1}},
            headers=headers, timeout=30,
        )  # fmt: skip
        assert response.status_code == 202, response.text
        done = webclient.get(
            f"{stack.base}/v1/jobs/{response.json()['id']}?wait=30", headers=headers, timeout=40
        )
        assert done.json()["status"] == "succeeded", done.text

    # Flower hears the batches through Celery's events, a little after they end: all of
    # them, but for any the worker says it could not send.
    deadline = time.monotonic() + 60
    while (seen := _batches_seen(url, auth)) < BATCHES - (dropped := _worker_dropped(stack)):
        if time.monotonic() > deadline:
            warnings = [line for line in stack.output if "warn" in line.lower()]
            raise AssertionError(
                f"Flower heard {seen} of {BATCHES} batches end; the worker dropped {dropped}"
                " events",
                warnings[-20:],
            )
        time.sleep(0.5)

    tasks = webclient.get(f"{url}/api/tasks", auth=auth, timeout=10)
    assert tasks.status_code == 200, tasks.text
    held = tasks.json()
    # The beat's feeder adds its own tasks beside the batches: the bound holds all of them.
    assert len(held) == BOUND, sorted(task["name"] for task in held.values())
    # What it keeps is the newest: every batch it holds was received after the last BOUND
    # batches began (they ran one after another). The feeder's tasks are not held to that:
    # Flower evicts the least recently updated task, and a feed received just before
    # halfway can be updated (started, succeeded) after a batch that came later.
    received = sorted((task["received"], task["name"]) for task in held.values())
    batches = [t for t in held.values() if t["name"].startswith("ferry.batch.")]
    assert batches, received
    assert all(task["received"] >= halfway for task in batches), (halfway, received)
