"""The Server-Sent Events a job's events become, and the Last-Event-ID a client resumes by."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from api.errors import ApiError
from api.jobs.events import done_of, resume_after, sse
from api.jobs.schemas import JobResource


def test_an_event_is_its_id_kind_and_one_line_of_json() -> None:
    data = {"index": 3, "token": 9, "text": "naïve\nline"}
    assert sse("token", data, "1700000000000-0") == (
        b"id: 1700000000000-0\nevent: token\n"
        b'data: {"index":3,"token":9,"text":"na\xc3\xafve\\nline"}\n\n'
    )
    assert sse("status", {"status": "queued"}) == b'event: status\ndata: {"status":"queued"}\n\n'


@pytest.mark.parametrize(
    ("header", "after"),
    [
        (None, None),
        ("", None),
        ("  ", None),
        ("1700000000000-0", "1700000000000-0"),
        (" 5-12 ", "5-12"),
    ],
)
def test_last_event_id_is_a_stream_id_or_nothing(header: str | None, after: str | None) -> None:
    assert resume_after(header) == after


@pytest.mark.parametrize("header", ["yesterday", "12", "1-2-3", "-1-0", "1-x", "9" * 21 + "-0"])
def test_anything_else_is_refused_naming_the_header(header: str) -> None:
    with pytest.raises(ApiError) as refused:
        resume_after(header)
    assert refused.value.status == 422
    assert refused.value.message.startswith("Last-Event-ID: ")


def job(status: str, output: Any) -> JobResource:
    now = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return JobResource.model_validate(
        {
            "id": "00000000-0000-0000-0000-000000000001",
            "model": "tiny-lm",
            "model_version": 1,
            "requested_version": None,
            "status": status,
            "priority": "normal",
            "created_at": now,
            "started_at": None,
            "finished_at": now,
            "deadline_at": None,
            "output": output,
            "error": None,
            "attempts": 1,
            "batch": None,
            "timings": {"queue_ms": None, "inference_ms": None, "total_ms": None},
            "callback": None,
            "metadata": None,
        }
    )


def test_the_done_made_from_a_row() -> None:
    assert done_of(job("succeeded", {"text": "a", "finish_reason": "stop"})).data == {
        "status": "succeeded",
        "finish_reason": "stop",
    }
    assert done_of(job("succeeded", [0.1, 0.2])).data == {"status": "succeeded"}  # an encoder's
    assert done_of(job("expired", None)).data == {"status": "expired"}
