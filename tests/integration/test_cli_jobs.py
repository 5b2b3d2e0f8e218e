"""`ferry jobs` and `ferry models` as a script runs them (off a terminal), against the API in
uvicorn with a real sim worker, Redis and the database."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from harness.served import Served
from tests.integration.conftest import RunningLoop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

Ferry = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def ferry(api: Served, token: str) -> Ferry:
    """``python -m ferry ARGS`` finding the API and key in the environment, as `ferry up`
    leaves them for a user (FERRY_API_URL, FERRY_API_KEY)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env |= {"FERRY_API_URL": api.base, "FERRY_API_KEY": token}

    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "ferry", *args],
            env=env, input=stdin, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    return run


def document(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert isinstance(found, dict)
    return found


def fields(run: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """A job printed off a terminal: ``name  value`` lines."""
    assert run.returncode == 0, run.stderr
    return dict(line.split(None, 1) for line in run.stdout.splitlines())


def test_submit_with_wait_prints_the_finished_job_as_json(
    ferry: Ferry, sim_worker: Callable[..., RunningLoop]
) -> None:
    with sim_worker():
        run = ferry("jobs", "submit", "sim", '{"cost": 3}', "--wait", "30", "--json")
    job = document(run)
    assert job["status"] == "succeeded" and job["model"] == "sim"
    assert job["output"]["cost"] == 3
    assert run.stdout.count("\n") == 1  # one document, on one line


def test_wait_returns_the_finished_job_and_get_prints_it_plain(
    ferry: Ferry, sim_worker: Callable[..., RunningLoop]
) -> None:
    queued = document(ferry("jobs", "submit", "sim", "-", "--priority", "vip", "--json",
                            stdin='{"cost": 2}'))  # fmt: skip
    assert queued["status"] == "queued" and queued["priority"] == "vip"
    with sim_worker():
        waited = ferry("jobs", "wait", queued["id"], "--timeout", "30", "--json")
    assert document(waited)["status"] == "succeeded"
    shown = fields(ferry("jobs", "get", queued["id"]))
    assert shown["id"] == queued["id"] and shown["status"] == "succeeded"
    assert json.loads(shown["output"])["cost"] == 2


def test_wait_exits_1_when_the_job_has_not_ended_in_time(ferry: Ferry) -> None:
    queued = document(ferry("jobs", "submit", "sim", '{"cost": 1}', "--json"))
    run = ferry("jobs", "wait", queued["id"], "--timeout", "0.5")
    assert run.returncode == 1, run.stderr
    shown = dict(line.split(None, 1) for line in run.stdout.splitlines())
    assert shown["id"] == queued["id"] and shown["status"] == "queued"


def test_list_is_a_plain_table_off_a_terminal_and_json_lines_with_json(ferry: Ferry) -> None:
    ids = [document(ferry("jobs", "submit", "sim", '{"cost": 1}', "--json"))["id"] for _ in "abc"]
    run = ferry("jobs", "list", "--model", "sim", "--limit", "2")
    assert run.returncode == 0, run.stderr
    header, *rows = run.stdout.splitlines()
    assert header.split() == ["id", "model", "status", "priority", "created", "finished"]
    assert [row.split()[0] for row in rows] == ids[:0:-1]  # the newest two, newest first
    assert all(row.split()[1:4] == ["sim", "queued", "normal"] for row in rows)
    assert all(row.split()[5] == "-" for row in rows)  # not finished
    assert "\x1b[" not in run.stdout and "─" not in run.stdout  # no colour, no box

    listed = ferry("jobs", "list", "--status", "queued", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == ids[::-1]


def test_cancel_prints_the_cancelled_job_and_a_second_cancel_is_an_error(ferry: Ferry) -> None:
    queued = document(ferry("jobs", "submit", "sim", '{"cost": 1}', "--json"))
    assert document(ferry("jobs", "cancel", queued["id"], "--json"))["status"] == "cancelled"
    again = ferry("jobs", "cancel", queued["id"])
    assert again.returncode == 1
    assert again.stderr.startswith("error: conflict: ")


def test_errors_name_the_apis_error_type_and_exit_1(ferry: Ferry, api: Served) -> None:
    unknown = ferry("jobs", "submit", "no-such-model", '{"cost": 1}')
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr.startswith("error: invalid_request: model: unknown model 'no-such-model'")
    missing = ferry("jobs", "get", "00000000-0000-0000-0000-000000000000")
    assert missing.returncode == 1 and missing.stderr.startswith("error: not_found: ")
    # The group's --api and --key are the command's own unless it gives its own.
    refused = ferry("jobs", "--api", api.base, "--key", "fy_nope_nope", "list")
    assert refused.returncode == 1 and refused.stderr.startswith("error: unauthorized: ")
    nowhere = ferry("jobs", "list", "--api", "http://127.0.0.1:9")
    assert nowhere.returncode == 1 and nowhere.stderr.startswith("error: connection: ")


def test_usage_errors_exit_2(ferry: Ferry) -> None:
    bad = ferry("jobs", "submit", "sim", "{not json")
    assert bad.returncode == 2 and "INPUT_JSON: not JSON" in bad.stderr
    assert ferry("jobs", "list", "--limit", "0").returncode == 2
    assert ferry("jobs", "frobnicate").returncode == 2


def test_models_lists_what_the_api_serves(ferry: Ferry) -> None:
    ferry("jobs", "submit", "sim", '{"cost": 1}', "--json")  # one job in sim's queue
    run = ferry("models")
    assert run.returncode == 0, run.stderr
    header, *rows = run.stdout.splitlines()
    assert header.split() == ["name", "version", "backend", "workers", "queue"]
    sim = next(row.split() for row in rows if row.split()[0] == "sim")
    assert sim[1:] == ["1", "sim", "0", "1"]

    assert ferry("models", "list").stdout == run.stdout
    listed = [json.loads(line) for line in ferry("models", "--json").stdout.splitlines()]
    assert ferry("models", "list", "--json").stdout.splitlines() == [
        json.dumps(m, separators=(",", ":"), ensure_ascii=False) for m in listed
    ]
    served_model = next(m for m in listed if m["name"] == "sim")
    assert served_model["backend"] == "sim" and sum(served_model["queue_depth"].values()) == 1
