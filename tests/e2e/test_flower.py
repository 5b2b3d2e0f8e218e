"""Flower in a real browser: `ferry up` starts it behind basic auth, headless Chromium logs in
and finds the GPU workers online (offline once stopped) and their batches as tasks.

Needs Debian's ``chromium`` and ``chromium-driver`` (.ci/run installs them). Without them the
test is skipped, except under CI, where it fails. Screenshots are kept in the test's
directory; with FERRY_SCREENSHOT_DIR set they are also written there (docs/ holds one).
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import webclient
from harness.processes import wait_for
from harness.stack import FerryUp
from tests.dashboard import families_used, family

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("CI"):
        raise RuntimeError("CI needs chromium and chromium-driver for the Flower browser test")
    pytest.skip(
        "needs Debian's chromium and chromium-driver (apt-get install chromium "
        "chromium-driver; .ci/run installs them, and under CI their absence is a failure)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


class Flower:
    def __init__(self, url: str, user: str, password: str) -> None:
        self.url = url
        self.user = user
        self.password = password


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FerryUp]:
    stack = FerryUp(tmp_path_factory.mktemp("flower"), FERRY_MODELS="sim")
    with stack.running():
        yield stack


@pytest.fixture(scope="module")
def flower(stack: FerryUp) -> Flower:
    banner = "".join(stack.output)
    match = re.search(r"Flower\s+(\S+)\s+\(user (\S+), password (\S+)\)", banner)
    assert match, banner[-2000:]
    found = Flower(*match.groups())
    # `ferry up` says it is up once its API is ready; Flower, a process of its own, may
    # still be starting (a test that asks it first, as a shuffled order may run, would
    # be refused), so it is waited for: it answers, asking for its login.
    wait_for("Flower to answer", functools.partial(_answers, found.url), 120)
    return found


def _answers(url: str) -> bool:
    try:
        return webclient.get(url, timeout=10).status_code == 401
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1600,1000"):  # fmt: skip
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _until(
    check: Callable[[], Any],
    timeout_s: float = 30.0,
    what: str = "",
    seen: Callable[[], Any] = lambda: None,
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = check()
        except Exception:  # the page is between renders
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}; saw {seen()}"
        time.sleep(0.25)


def _shoot(driver: webdriver.Chrome, directory: Path, name: str) -> None:
    path = directory / f"{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, "a blank screenshot"
    if target := os.environ.get("FERRY_SCREENSHOT_DIR"):
        shutil.copy(path, Path(target) / path.name)


def _submit(stack: FerryUp, body: dict[str, Any]) -> str:
    response = webclient.post(
        f"{stack.base}/v1/jobs",
        json={"model": "sim", **body},
        headers={"Authorization": f"Bearer {stack.token}"},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def _rows(driver: webdriver.Chrome, table: str) -> list[str]:
    """A table's rows as 'cell | cell | ...' (textContent: no line breaks from the layout).

    Read in one script, within one turn of the page's own: Flower redraws the
    table every second, and cells read one by one can vanish between reads.
    """
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]), row =>"
        " Array.from(row.querySelectorAll('td'), cell => cell.textContent.trim()).join(' | '))",
        f"#{table} tbody tr",
    )
    return [str(row) for row in rows]


def _worker_row(driver: webdriver.Chrome, prefix: str) -> str | None:
    return next((row for row in _rows(driver, "workers-table") if row.startswith(prefix)), None)


def test_flower_shows_the_gpu_workers_and_their_batches(
    stack: FerryUp, flower: Flower, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    # Without credentials Flower answers 401 and shows nothing.
    browser.get(f"{flower.url}/workers")
    assert "ferry-" not in browser.page_source
    assert webclient.get(f"{flower.url}/workers", timeout=10).status_code == 401

    # Log in: every request the browser makes carries the basic-auth credentials.
    token = base64.b64encode(f"{flower.user}:{flower.password}".encode()).decode()
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
    )

    # Some batches (jobs sent at once, so they share batches), one with a failing job.
    bodies: list[dict[str, Any]] = [{"input": {"cost": 4}}] * 24
    bodies += [{"input": {"cost": 2}, "priority": "urgent"}] * 4
    bodies += [{"input": {"cost": 1, "fail": True}}]
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda body: _submit(stack, body), bodies))
    for job_id in ids:
        webclient.get(
            f"{stack.base}/v1/jobs/{job_id}?wait=20",
            headers={"Authorization": f"Bearer {stack.token}"},
            timeout=30,
        )

    # A second GPU worker, started beside the stack and stopped later.
    extra = stack.spawn([sys.executable, "-m", "ferry", "worker", "--model", "sim",
                         "--name", "extra-sim"])  # fmt: skip
    own = f"ferry-sim@{socket.gethostname()}:sim:"  # the stack's worker (host:model:device)

    def table() -> list[str]:
        return _rows(browser, "workers-table")

    def online(prefix: str) -> str | None:
        row = _worker_row(browser, prefix)
        return row if row is not None and "Online" in row else None

    try:
        browser.get(f"{flower.url}/workers")
        # The page refreshes its table every second.
        _until(lambda: online(own), what="the stack's GPU worker online", seen=table)
        _until(
            lambda: online("ferry-sim@extra-sim"), what="the second GPU worker online", seen=table
        )
        _until(lambda: online("ferry-celery@"), what="the Celery worker online", seen=table)
        _shoot(browser, tmp_path, "flower-workers")

        # A GPU worker's own page: Flower inspects it, and it answers with what it is.
        name = str(_worker_row(browser, own)).split(" | ")[0]
        browser.get(f"{flower.url}/worker/{quote(name)}")
        _until(lambda: "ferry.batch.sim" in browser.page_source, what="the worker's page")
        # The "Other" tab: what Ferry adds (model, device, consumer, batch figures).
        browser.find_element(By.ID, "worker-tab-other").click()
        _until(
            lambda: "show" in str(browser.find_element(By.ID, "tab-other").get_attribute("class")),
            what="the Other tab",
        )
        time.sleep(0.5)  # its fade-in, for the screenshot
        _shoot(browser, tmp_path, "flower-worker")
        # Flower humanizes names ("avg_batch_ms" shows as "Avg batch ms").
        page = browser.page_source.lower().replace("_", " ")
        # Its pool, its batch figures and its four streams (the stack's default key prefix).
        for text in ("ferry batch loop", "avg batch ms", "stream consumer", "ferry:{sim}:urgent"):
            assert text in page, text
    finally:
        extra.send_signal(signal.SIGTERM)
        try:
            assert extra.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            extra.kill()
            raise

    # Stopped: offline (its worker-offline event), while the stack's worker stays online.
    browser.get(f"{flower.url}/workers")
    _until(
        lambda: "Offline" in (_worker_row(browser, "ferry-sim@extra-sim") or ""),
        what="the stopped worker offline",
    )
    assert online(own)

    # The Tasks page, filtered to the batches (its name filter, as a link into it gives):
    # unfiltered, its first page is the newest fifteen tasks, and the beat's backfill
    # feeds (one a second) and the webhooks push the batches off it.
    browser.get(f"{flower.url}/tasks?name=ferry.batch.sim")

    def rows() -> list[str]:
        return _rows(browser, "tasks-table")

    _until(
        lambda: (
            any("ferry.batch.sim" in r and "SUCCESS" in r for r in rows())
            and any("ferry.batch.sim" in r and "FAILURE" in r for r in rows())
        ),
        what="succeeded and failed ferry.batch.sim tasks",
        seen=rows,
    )
    # The filter is Flower's search, shown in its box, and the page holds only batches.
    search = browser.find_element(By.CSS_SELECTOR, "input[type=search]")
    assert search.get_attribute("value") == "name:ferry.batch.sim"
    _until(lambda: rows() and all("ferry.batch.sim" in r for r in rows()), what="only batches")
    batches = rows()
    assert all(("SUCCESS" in r) != ("FAILURE" in r) for r in batches), batches
    _shoot(browser, tmp_path, "flower-tasks")

    # A batch's own page: its id, its arguments (size, cost, lanes), its worker.
    failed = next(r for r in batches if "FAILURE" in r)
    batch_id = re.search(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", failed)
    assert batch_id, failed
    browser.get(f"{flower.url}/task/{batch_id.group()}")
    page = _until(lambda: browser.find_element(By.TAG_NAME, "body").text, what="task page")
    for text in ("ferry.batch.sim", "FAILURE", "'size': ", "'cost': ", "'lanes': {", "'normal': ",
                 "jobs failed", "ferry-sim@"):  # fmt: skip
        assert text in page, (text, page)
    _shoot(browser, tmp_path, "flower-batch")

    # Celery's own tasks show as usual beside the batches (beat runs the feeder every second).
    browser.get(f"{flower.url}/tasks")
    search = browser.find_element(By.CSS_SELECTOR, "input[type=search]")
    search.clear()
    search.send_keys("ferry.backfills.feed")
    _until(
        lambda: any("ferry.backfills.feed" in r and "SUCCESS" in r for r in rows()),
        what="Celery's feed task",
        seen=rows,
    )


def _ready(port: int) -> bool:
    return webclient.get(f"http://127.0.0.1:{port}/readyz", timeout=10).is_success


def test_every_process_is_ready_and_the_dashboard_metrics_exist(
    stack: FerryUp, flower: Flower
) -> None:
    """What the Grafana dashboard asks for is exported by the running stack (GPU ones need NVML)."""
    base = int(stack.env["FERRY_METRICS_PORT_BASE"])
    ports = {"worker-sim": base, "celery-worker": base + 1}  # ferry up's order: models, Celery
    pages = [webclient.get(f"{stack.base}/metrics", timeout=10).text]
    for name, port in ports.items():
        assert webclient.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        # `ferry up` says it is up once the API is ready; a worker may still be starting
        # (Celery's is ready at its worker_ready signal), so its readiness is waited for.
        wait_for(f"{name} to be ready", functools.partial(_ready, port), 120)
        pages.append(webclient.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    # Flower's /metrics asks for its login too (no metrics token in this stack).
    assert webclient.get(f"{flower.url}/metrics", timeout=10).status_code == 401
    pages.append(
        webclient.get(f"{flower.url}/metrics", auth=(flower.user, flower.password), timeout=10).text
    )
    exported = {
        family(parsed.name) for page in pages for parsed in text_string_to_metric_families(page)
    }
    wanted = {name for name in families_used() if not name.startswith("ferry_gpu_")}
    assert wanted - exported == set()
