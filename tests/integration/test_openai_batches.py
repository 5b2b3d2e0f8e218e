"""OpenAI's Files and Batch APIs through the real ``openai`` package, over Ferry's backfills:
a real minilm worker, the real feeder, a real Redis and both databases."""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db.keys import create_key
from core.db.schema import Backfill, FilePart, Job, OpenAIBatch, utcnow
from core.models.inputs import count_tokens
from harness import webclient
from harness.served import Served, served
from tests.integration.conftest import RunningLoop
from tests.integration.test_backfills import RunningFeeder, make_feeder
from tests.vectors import cosine
from workers.gpu.main import build_loop
from workers.tasks.app import purge_results

TOPICS = ("cats", "trains", "rivers", "taxes")


def request(custom_id: str, text: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "minilm", "input": text, **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return "".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines
    ).encode()


def text(n: int) -> str:
    return f"request {n} is about {TOPICS[n % len(TOPICS)]}"


@pytest.fixture
def client(api: Served, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client:
        yield client


def upload(client: openai.OpenAI, lines: list[Any], name: str = "batch.jsonl") -> str:
    return client.files.create(file=(name, io.BytesIO(jsonl(lines))), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str], limit_s: float = 180):  # type: ignore[no-untyped-def]
    until = time.monotonic() + limit_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < until, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def test_a_batch_runs_end_to_end(
    client: openai.OpenAI,
    settings: Settings,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    lines = [request(f"req-{n}", text(n)) for n in range(40)]
    lines[3] = request("req-3", [text(3)])  # a list of one text is one text
    lines[5] = request("req-5", text(5), encoding_format="base64", user="u-5")
    lines[7] = request("req-7", text(7), dimensions=384)
    raw = jsonl([*lines[:20], "", *lines[20:]])  # a blank line is skipped, as OpenAI does
    uploaded = client.files.create(file=("embed.jsonl", io.BytesIO(raw)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(raw)
    assert uploaded.filename == "embed.jsonl" and uploaded.id.startswith("file-")
    assert client.files.retrieve(uploaded.id).bytes == len(raw)
    assert client.files.content(uploaded.id).content == raw

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/embeddings",
        completion_window="24h",
        metadata={"team": "search"},
    )
    assert batch.status == "in_progress" and batch.model == "minilm"
    assert batch.request_counts is not None and batch.request_counts.total == 40
    assert batch.metadata == {"team": "search"} and batch.output_file_id is None
    assert batch.expires_at is not None
    assert batch.expires_at - batch.created_at == pytest.approx(24 * 3600, abs=2)

    with (
        RunningLoop(build_loop(settings, "minilm", name="batch-test")),
        RunningFeeder(make_feeder(sessions, redis_client, settings)),
    ):
        done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
    assert done.completed_at is not None and done.error_file_id is None
    assert done.output_file_id is not None

    content = client.files.content(done.output_file_id).content
    output = [json.loads(line) for line in content.decode().splitlines()]
    assert [line["custom_id"] for line in output] == [f"req-{n}" for n in range(40)]
    assert all(line["error"] is None for line in output)
    assert {line["response"]["status_code"] for line in output} == {200}
    assert len({line["id"] for line in output}) == 40

    tokenizer = build_catalog(settings)["minilm"].input.tokenizer
    tokens = [count_tokens(text(n), tokenizer) for n in range(40)]
    assert [line["response"]["body"]["usage"]["prompt_tokens"] for line in output] == tokens
    assert done.usage is not None and done.usage.input_tokens == sum(tokens)

    vectors = {}
    for n, line in enumerate(output):
        (item,) = line["response"]["body"]["data"]
        vector = item["embedding"]
        if n == 5:  # base64: little-endian float32, as OpenAI sends it
            vector = list(struct.unpack("<384f", base64.b64decode(vector)))
        vectors[n] = vector
        assert len(vector) == 384 and line["response"]["body"]["model"] == "minilm"
    # The same vectors the embeddings route gives for the same texts.
    with RunningLoop(build_loop(settings, "minilm", name="batch-check")):
        direct = client.embeddings.create(model="minilm", input=[text(n) for n in (0, 3, 5)])
    for index, n in enumerate((0, 3, 5)):
        assert cosine(vectors[n], direct.data[index].embedding) > 0.9999
    assert cosine(vectors[0], vectors[4]) > cosine(vectors[0], vectors[1])  # both about cats

    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output" and output_file.bytes == len(content)
    listed = {f.id: f.purpose for f in client.files.list()}
    assert listed[uploaded.id] == "batch" and listed[done.output_file_id] == "batch_output"
    assert [b.id for b in client.batches.list()] == [batch.id]

    with sessions() as session:
        stored = session.get(OpenAIBatch, batch.id)
        assert stored is not None and stored.backfill_id is not None
        jobs = session.scalars(select(Job).where(Job.backfill_id == stored.backfill_id)).all()
    # Each request was a job of its own in the bulk lane, spread over the worker's batches.
    assert len(jobs) == 40 and {job.priority for job in jobs} == {"bulk"}
    assert len({job.batch_id for job in jobs}) > 1
    assert next(job for job in jobs if job.custom_id == "req-5").metadata_ == {
        "openai": "batch",
        "encoding_format": "base64",
        "user": "u-5",
    }


BAD_FILES = [
    (
        [
            request("a", "x"),
            request("b", "y"),
            {**request("c", "z"), "body": {"model": "sim", "input": "z"}},
        ],
        3,
        "mismatched_model",
        "body.model",
    ),
    (
        [request("a", "x"), {**request("b", "y"), "url": "/v1/chat/completions"}],
        2,
        "invalid_url",
        "url",
    ),
    ([request("a", "x"), {**request("b", "y"), "method": "GET"}], 2, "invalid_method", "method"),
    ([request("a", "x"), request("a", "y")], 2, "duplicate_custom_id", "custom_id"),
    ([request("a", "x"), "{not json"], 2, "invalid_json_line", None),
    ([request("a", ["x", "y"])], 1, "invalid_request", "body.input"),
    ([request("a", "x", dimensions=64)], 1, "invalid_request", "body.dimensions"),
    (
        [{**request("a", "x"), "body": {"model": "gpt-embed", "input": "x"}}],
        1,
        "model_not_found",
        "body.model",
    ),
    (
        [{**request("a", "x"), "body": {"model": "sim", "input": "x"}}],
        1,
        "invalid_request",
        "body.model",
    ),
    (
        [{"method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm", "input": "x"}}],
        1,
        "invalid_request",
        "custom_id",
    ),
]


@pytest.mark.parametrize(("lines", "line", "code", "param"), BAD_FILES)
def test_a_bad_file_fails_the_batch_with_the_line_and_why(
    client: openai.OpenAI,
    sessions: sessionmaker[Session],
    lines: list[Any],
    line: int,
    code: str,
    param: str | None,
) -> None:
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    (error,) = batch.errors.data
    assert (error.line, error.code, error.param) == (line, code, param), error.message
    assert client.batches.retrieve(batch.id).status == "failed"
    with sessions() as session:
        stored = session.get(OpenAIBatch, batch.id)
        assert stored is not None
        # Nothing of a refused file runs or stays: no job, and a failed backfill if any.
        if stored.backfill_id is not None:
            assert session.get(Backfill, stored.backfill_id).status == "failed"  # type: ignore[union-attr]
            count = session.scalar(
                select(func.count()).select_from(Job).where(Job.backfill_id == stored.backfill_id)
            )
            assert count == 0


def test_bad_requests_are_refused_in_openais_words(client: openai.OpenAI) -> None:
    file_id = upload(client, [request("a", "x")])
    cases: list[tuple[dict[str, Any], type[openai.APIStatusError], str]] = [
        ({"endpoint": "/v1/responses"}, openai.BadRequestError, "endpoint"),
        ({"completion_window": "2d"}, openai.BadRequestError, "completion_window"),
        ({"input_file_id": "file-nothere"}, openai.NotFoundError, "input_file_id"),
        ({"metadata": {"k": "v" * 513}}, openai.BadRequestError, "metadata"),
    ]
    for change, kind, param in cases:
        arguments: dict[str, Any] = {
            "input_file_id": file_id,
            "endpoint": "/v1/embeddings",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(kind) as refused:
            client.batches.create(**arguments)
        assert refused.value.body["param"] == param, refused.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    assert wrong_purpose.value.body["param"] == "purpose"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        client.files.create(file=("x.jsonl", io.BytesIO(b"")), purpose="batch")
    assert empty.value.body["param"] == "file"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nothere")


def test_a_file_too_large_is_refused_and_nothing_stays(
    settings: Settings, token: str, sessions: sessionmaker[Session]
) -> None:
    small = settings.model_copy(update={"backfill_max_bytes": 4096})
    with (
        served(small) as api,
        openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client,
    ):
        lines = [request(f"r{n}", text(n)) for n in range(60)]
        with pytest.raises(openai.APIStatusError) as refused:
            upload(client, lines)
        assert refused.value.status_code == 413
        assert client.files.list().data == []
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FilePart)) == 0


def test_cancel_puts_what_did_not_run_in_the_error_file(
    client: openai.OpenAI,
    settings: Settings,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    file_id = upload(client, [request(f"r{n}", text(n)) for n in range(30)])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    cancelling = client.batches.cancel(batch.id)  # no worker: nothing has run
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    feeder = make_feeder(sessions, redis_client, settings)
    feeder.step()
    feeder.step()
    done = client.batches.retrieve(batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 30)
    assert done.output_file_id is None and done.error_file_id is not None
    errors = [
        json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()
    ]
    assert [e["custom_id"] for e in errors] == [f"r{n}" for n in range(30)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert {json.dumps(e["response"]) for e in errors} == {"null"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no error
    refused = client.batches.create(
        input_file_id=upload(client, [request("x", ["a", "b"])]),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(refused.id)


def test_the_completion_window_expires_what_has_not_run(
    client: openai.OpenAI,
    settings: Settings,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    file_id = upload(client, [request(f"r{n}", text(n)) for n in range(20)])
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/embeddings",
        completion_window="1h",  # type: ignore[arg-type]  # OpenAI's clients know only 24h
    )
    assert batch.expires_at is not None
    assert batch.expires_at - batch.created_at == pytest.approx(3600, abs=2)
    # A feeder that lives an hour and a minute later sees the window ended.
    later = make_feeder(
        sessions, redis_client, settings, clock=lambda: utcnow() + dt.timedelta(minutes=61)
    )
    later.step()
    later.step()
    done = client.batches.retrieve(batch.id)
    assert done.status == "expired" and done.expired_at is not None
    assert done.request_counts is not None and done.request_counts.failed == 20
    assert done.error_file_id is not None
    errors = [
        json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()
    ]
    assert len(errors) == 20 and {e["error"]["code"] for e in errors} == {"batch_expired"}
    with sessions() as session:
        stored = session.get(OpenAIBatch, batch.id)
        assert stored is not None
        backfill = session.get(Backfill, stored.backfill_id)
        assert backfill is not None and (backfill.status, backfill.expired) == ("expired", 20)


def test_another_keys_files_and_batches_are_not_there(
    client: openai.OpenAI, api: Served, sessions: sessionmaker[Session]
) -> None:
    file_id = upload(client, [request("a", "x")])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    with sessions() as session:
        other_token = create_key(session, "other").token
    with openai.OpenAI(base_url=f"{api.base}/v1", api_key=other_token, max_retries=0) as other:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(batch.id)
        assert other.files.list().data == [] and other.batches.list().data == []


def test_a_deleted_file_is_gone_and_its_batch_runs_on(
    client: openai.OpenAI, sessions: sessionmaker[Session]
) -> None:
    file_id = upload(client, [request("a", "x")])
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deleted = client.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(FilePart)) == 0


def test_the_keys_embeddings_lane_unless_the_header_names_one(
    api: Served, sessions: sessionmaker[Session], settings: Settings
) -> None:
    with sessions() as session:
        token = create_key(session, "vip", embeddings_lane="vip").token
    with (
        RunningLoop(build_loop(settings, "minilm", name="lane-test")),
        openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client,
    ):
        client.embeddings.create(model="minilm", input=["one", "two"])
        client.embeddings.create(
            model="minilm", input="three", extra_headers={"X-Ferry-Priority": "urgent"}
        )
    with sessions() as session:
        lanes = {str(job.input): job.priority for job in session.scalars(select(Job))}
    assert lanes == {"one": "vip", "two": "vip", "three": "urgent"}


def test_the_purge_takes_finished_batches_with_their_files_and_keeps_running_ones(
    client: openai.OpenAI,
    settings: Settings,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    live_upload = upload(client, [request("a", "x")])
    expiring = client.files.create(
        file=("e.jsonl", io.BytesIO(jsonl([request("a", "x")]))),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    ).id
    finished = client.batches.create(
        input_file_id=upload(client, [request(f"r{n}", text(n)) for n in range(5)]),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    client.batches.cancel(finished.id)
    feeder = make_feeder(sessions, redis_client, settings)
    feeder.step()
    feeder.step()
    error_file = client.batches.retrieve(finished.id).error_file_id
    assert error_file is not None
    running = client.batches.create(
        input_file_id=live_upload, endpoint="/v1/embeddings", completion_window="24h"
    )
    with sessions.begin() as session:
        stored = session.get(OpenAIBatch, running.id)
        assert stored is not None
        # One line of the running batch finished long ago: kept while the batch runs.
        job = session.scalars(select(Job).where(Job.backfill_id == stored.backfill_id)).one()
        job.status, job.finished_at = "succeeded", utcnow()
    purge_results(settings, now=utcnow() + dt.timedelta(seconds=settings.result_ttl_s + 60))
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve(finished.id)
    for gone in (error_file, expiring):
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(gone)
    assert client.batches.retrieve(running.id).status == "in_progress"
    assert client.files.retrieve(live_upload).bytes > 0
    with sessions() as session:
        assert session.get(Job, job.id) is not None
        assert (
            session.scalar(
                select(func.count()).select_from(FilePart).where(FilePart.file_id == expiring)
            )
            == 0
        )


def test_an_upload_of_unknown_size_is_refused_before_it_is_read(api: Served, token: str) -> None:
    def body() -> Iterator[bytes]:  # sent chunked: no Content-Length
        yield b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--x--\r\n'

    answer = webclient.post(
        f"{api.base}/v1/files",
        content=body(),
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "multipart/form-data; boundary=x",
        },
    )
    assert answer.status_code == 411, answer.text
    assert answer.json()["error"]["param"] == "file"
    garbled = webclient.post(
        f"{api.base}/v1/files",
        content=b"not multipart at all",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "multipart/form-data; boundary=x",
        },
    )
    assert garbled.status_code == 400, garbled.text
    assert garbled.json()["error"]["param"] == "file"
