"""GET /v1/jobs/{id}/events and DELETE on a running generation, on the real app in
uvicorn, real Redis and both databases; the generation worker's writes are
played by hand (``PlayedWorker``), the encoder jobs run on a real sim worker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from core.config.settings import Settings
from core.db.schema import Job, utcnow
from core.streams.protocol import cancels_key
from harness import webclient
from harness.served import Served
from tests.integration.conftest import RunningLoop
from tests.integration.gen_api import MODEL, EventReader, Message, PlayedWorker, generation_api

TOKENS = [(5, "hello"), (6, " world"), (7, ""), (8, " the"), (9, " cat")]


@pytest.fixture
def api(settings: Settings, tmp_path: Path) -> Iterator[Served]:
    with generation_api(settings, tmp_path) as running:
        yield running


@pytest.fixture
def http(api: Served, auth: dict[str, str]) -> Iterator[httpx.Client]:
    with webclient.client(base_url=api.base, headers=auth, timeout=20) as client:
        yield client


@pytest.fixture
def submit(http: httpx.Client) -> Callable[..., str]:
    def make(model: str = MODEL, value: object = None) -> str:
        answer = http.post(
            "/v1/jobs", json={"model": model, "input": value or {"prompt": "the cat", "seed": 1}}
        )
        assert answer.status_code == 202, answer.text
        return str(answer.json()["id"])

    return make


@pytest.fixture
def worker(
    redis_client: redis.Redis, sessions: sessionmaker[Session], key_prefix: str
) -> Callable[[str], PlayedWorker]:
    return lambda job_id: PlayedWorker(redis_client, sessions, key_prefix, job_id)


def events(http: httpx.Client, job_id: str, last: str | None = None) -> list[Message]:
    headers = {"Last-Event-ID": last} if last else {}
    with http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return EventReader(response).all()


def test_a_finished_generation_streams_its_status_then_every_event(
    http: httpx.Client, submit: Callable[..., str], worker: Callable[[str], PlayedWorker]
) -> None:
    job_id = submit()
    played = worker(job_id)
    played.run(TOKENS)
    got = events(http, job_id)
    # The row's status first, without an id; then the stream's entries under their ids.
    assert (got[0].event, got[0].data, got[0].id) == ("status", {"status": "succeeded"}, None)
    assert [m.id for m in got[1:]] == played.ids
    assert [m.event for m in got[1:]] == ["status"] + ["token"] * len(TOKENS) + ["done"]
    assert got[1].data == {"status": "running"}
    assert [m.data for m in got[2:-1]] == [
        {"index": i, "token": token, "text": text} for i, (token, text) in enumerate(TOKENS)
    ]
    assert got[-1].data == {"status": "succeeded", "finish_reason": "length"}


def test_a_dropped_stream_resumed_after_its_last_event_loses_and_repeats_nothing(
    http: httpx.Client, submit: Callable[..., str], worker: Callable[[str], PlayedWorker]
) -> None:
    job_id = submit()
    played = worker(job_id)
    played.start()
    for index, (token, text) in enumerate(TOKENS[:3]):
        played.token(index, token, text)
    seen: list[Message] = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)
        while len(seen) < 1 + 1 + 2:  # status, running, two tokens: then the line drops
            message = reader.next()
            assert message is not None
            seen.append(message)
    for index, (token, text) in enumerate(TOKENS[3:], start=3):
        played.token(index, token, text)
    played.finish(TOKENS)
    rest = events(http, job_id, last=seen[-1].id)
    assert rest[0].id is None and rest[0].event == "status"
    tokens = [m.data["token"] for m in seen[2:] + rest[1:] if m.event == "token"]
    assert tokens == [token for token, _ in TOKENS]
    assert [m.id for m in seen[1:] + rest[1:]] == played.ids


def test_events_arrive_as_the_worker_writes_them(
    http: httpx.Client, submit: Callable[..., str], worker: Callable[[str], PlayedWorker]
) -> None:
    job_id = submit()
    played = worker(job_id)
    got: list[tuple[float, Message]] = []

    def write() -> None:
        time.sleep(0.3)
        played.start()
        for index, (token, text) in enumerate(TOKENS):
            time.sleep(0.1)
            played.token(index, token, text)
        played.finish(TOKENS)

    writer = threading.Thread(target=write)
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        writer.start()
        reader = EventReader(response)
        while (message := reader.next()) is not None:
            got.append((time.monotonic(), message))
    writer.join()
    assert got[0][1].data == {"status": "queued"}
    assert [m.event for _, m in got] == ["status", "status"] + ["token"] * 5 + ["done"]
    # Each token came when it was written, not all at the end.
    assert got[-1][0] - got[2][0] > 0.3


def test_a_finished_job_whose_stream_is_gone_gets_one_done_from_its_row(
    http: httpx.Client,
    submit: Callable[..., str],
    worker: Callable[[str], PlayedWorker],
    redis_client: redis.Redis,
) -> None:
    job_id = submit()
    played = worker(job_id)
    played.run(TOKENS, finish_reason="stop")
    redis_client.delete(played.key)  # expired
    got = events(http, job_id)
    assert [(m.event, m.data, m.id) for m in got] == [
        ("status", {"status": "succeeded"}, None),
        ("done", {"status": "succeeded", "finish_reason": "stop"}, None),
    ]


def test_a_queued_generation_cancelled_ends_its_stream(
    http: httpx.Client, submit: Callable[..., str]
) -> None:
    job_id = submit()
    got: list[Message] = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)
        first = reader.next()
        assert first is not None and first.data == {"status": "queued"}
        assert http.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
        got = reader.all()  # no event was written: the done channel ends it
    assert [(m.event, m.data) for m in got] == [("done", {"status": "cancelled"})]


def test_an_encoder_job_streams_its_status_and_done(
    http: httpx.Client, submit: Callable[..., str], sim_worker: Callable[..., RunningLoop]
) -> None:
    job_id = submit("sim", {"cost": 1})
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)
        first = reader.next()
        assert first is not None and first.data == {"status": "queued"}
        with sim_worker():
            got = reader.all()
    assert [(m.event, m.data) for m in got] == [("done", {"status": "succeeded"})]
    assert events(http, job_id)[-1].data == {"status": "succeeded"}


def test_a_quiet_stream_gets_keep_alive_comments(
    http: httpx.Client, submit: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("api.jobs.events.HEARTBEAT_S", 0.2)
    monkeypatch.setattr("api.jobs.events.BLOCK_MS", 100)
    job_id = submit()
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)
        assert reader.next() is not None
        started = time.monotonic()
        for line in reader.lines:
            if line.startswith(":"):
                reader.comments.append(line)
            if len(reader.comments) >= 2 or time.monotonic() - started > 5:
                break
    assert reader.comments[:2] == [": keep-alive", ": keep-alive"]


def test_a_client_that_disconnects_ends_the_reading(
    http: httpx.Client, submit: Callable[..., str], redis_client: redis.Redis, key_prefix: str
) -> None:
    job_id = submit()
    # The process's reader of the model's events streams (api.jobs.tails): one
    # connection, blocked in XREAD while a client follows one of them.
    name = f"{key_prefix}-events-{MODEL}"

    def blocked() -> list[object]:
        return [
            c
            for c in redis_client.client_list()
            if c.get("name") == name and "b" in str(c.get("flags", ""))
        ]

    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)  # held: dropping its line iterator closes the response
        assert reader.next() is not None
        until = time.monotonic() + 5
        while not blocked():
            assert time.monotonic() < until, "the reader's XREAD never showed"
            time.sleep(0.05)
        assert len([c for c in redis_client.client_list() if c.get("name") == name]) == 1
    # The client is gone mid-XREAD BLOCK: its place among the readers is given up, and
    # with no reader left the XREAD is not sent again.
    until = time.monotonic() + 5
    while blocked():
        assert time.monotonic() < until, "the read outlived its client"
        time.sleep(0.05)


def test_another_keys_job_and_a_bad_last_event_id(
    http: httpx.Client, api: Served, submit: Callable[..., str], make_token: Callable[[str], str]
) -> None:
    job_id = submit()
    other = {"Authorization": f"Bearer {make_token('other')}"}
    assert webclient.get(f"{api.base}/v1/jobs/{job_id}/events", headers=other).status_code == 404
    bad = http.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "yesterday"})
    assert bad.status_code == 422 and "Last-Event-ID" in bad.json()["error"]["message"]
    # Past what a stream id holds (64 bits a part): refused, never sent to Redis.
    huge = http.get(
        f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "99999999999999999999-0"}
    )
    assert huge.status_code == 422 and "Last-Event-ID" in huge.json()["error"]["message"]


def test_deleting_a_running_generation_asks_its_worker_to_stop_it(
    http: httpx.Client,
    submit: Callable[..., str],
    worker: Callable[[str], PlayedWorker],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    job_id = submit()
    worker(job_id).start()
    answer = http.delete(f"/v1/jobs/{job_id}")
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert body["status"] == "running" and body["cancel_requested"] is True
    key = cancels_key(key_prefix, MODEL)
    assert redis_client.smembers(key) == {job_id}
    assert 0 < redis_client.ttl(key) <= 600


def test_delete_still_cancels_a_queued_job_and_refuses_the_others(
    http: httpx.Client,
    submit: Callable[..., str],
    worker: Callable[[str], PlayedWorker],
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    queued = submit()
    answer = http.delete(f"/v1/jobs/{queued}")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    assert "cancel_requested" not in answer.json()
    finished = submit()
    worker(finished).run(TOKENS)
    assert http.delete(f"/v1/jobs/{finished}").status_code == 409
    encoder = submit("sim", {"cost": 1})
    with sessions.begin() as session:
        session.execute(
            update(Job).where(Job.id == encoder).values(status="running", started_at=utcnow())
        )
    refused = http.delete(f"/v1/jobs/{encoder}")
    assert refused.status_code == 409 and "running" in refused.json()["error"]["message"]
    assert not redis_client.exists(cancels_key(key_prefix, "sim"))
    assert not redis_client.exists(cancels_key(key_prefix, MODEL))


def test_the_openapi_document_has_the_generation_routes(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    events = spec["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]
    assert "text/event-stream" in events["200"]["content"] and "404" in events
    assert "202" in spec["paths"]["/v1/jobs/{job_id}"]["delete"]["responses"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"200", "400", "404", "409"} <= set(spec["paths"][path]["post"]["responses"])
