"""POST /v1/completions and /v1/chat/completions through the real ``openai`` package, and
a job's events resumed by Last-Event-ID, on a real generation worker.

The API runs in uvicorn; the worker loop of a llama-shaped model folder
(``tests.lm``, random weights: its text is noise, but it is the worker's)
runs in a thread, as the other integration tests run theirs.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from sqlalchemy.orm import Session, sessionmaker
from tokenizers import Tokenizer

from core.config.settings import Settings
from harness import webclient
from harness.served import Served, served
from tests.integration.gen_api import EventReader, Message
from tests.integration.generation_worker import (
    MODEL,
    generation_settings,
    slow_steps,
    start_worker,
)
from tests.integration.test_backfills import RunningFeeder, make_feeder
from tests.lm import lm_folder

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")

CHAT: list[Any] = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hello"},
]


@pytest.fixture
def gen_settings(settings: Settings, tmp_path: Path) -> Settings:
    made = generation_settings(settings, tmp_path, beside=("sim",))
    return made.model_copy(update={"max_wait_s": 60.0})


@pytest.fixture
def api(gen_settings: Settings) -> Iterator[Served]:
    with served(gen_settings) as running:
        yield running


@pytest.fixture
def worker(gen_settings: Settings) -> Iterator[None]:
    with start_worker(gen_settings, "openai-gen-worker"):
        yield


@pytest.fixture
def client(api: Served, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as made:
        yield made


@pytest.fixture
def http(api: Served, auth: dict[str, str]) -> Iterator[httpx.Client]:
    with webclient.client(base_url=api.base, headers=auth, timeout=60) as made:
        yield made


def job_of(http: httpx.Client, job_id: str) -> Any:
    found = http.get(f"/v1/jobs/{job_id}", params={"wait": 30}).json()
    assert found["status"] == "succeeded", found
    return found


def test_a_chat_completion_is_the_jobs_output(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=8,
        temperature=0,
        user="user-7",
    )
    answer = raw.parse()
    job = job_of(http, raw.headers["X-Ferry-Job-Id"])
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.id == "chatcmpl-" + job["id"].replace("-", "")
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == job["output"]["text"]
    assert choice.finish_reason == job["output"]["finish_reason"] in ("stop", "length")
    assert answer.usage is not None
    assert answer.usage.model_dump() == {
        **job["output"]["usage"],
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }
    assert answer.usage.completion_tokens == len(job["output"]["token_ids"])
    assert job["metadata"] == {"openai": "chat.completions", "user": "user-7"}


def test_a_streamed_chat_completion_is_the_same_text_token_by_token(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
    )
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(raw.parse())
    assert raw.headers["content-type"].startswith("text/event-stream")
    job = job_of(http, raw.headers["X-Ferry-Job-Id"])
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(texts) == job["output"]["text"] == whole.choices[0].message.content
    assert len([t for t in texts if t]) > 1  # it came in pieces
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[:-1] == [None] * (len(finish) - 1)
    assert finish[-1] == job["output"]["finish_reason"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.total_tokens == job["output"]["usage"]["total_tokens"]


def test_a_completion_streamed_and_not(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    whole = client.completions.create(
        model=MODEL, prompt="Ferry queues", max_tokens=6, temperature=0
    )
    assert whole.object == "text_completion"
    streamed = client.completions.create(
        model=MODEL, prompt=["Ferry queues"], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"n": 17}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"temperature": 5}, "temperature"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"extra_body": {"top_k": 5}}, "top_k"),
        ({"extra_body": {"priority": "soon"}}, "priority"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"7": 101}}, "logit_bias.7"),
        ({"logit_bias": {"999999": 1}}, "logit_bias.999999"),
        ({"logit_bias": {"7": "high"}}, "logit_bias.7"),
        ({"logit_bias": [7]}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(
    client: openai.OpenAI, options: dict[str, Any], param: str
) -> None:
    arguments: dict[str, Any] = {"model": MODEL, "messages": CHAT, **options}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**arguments)
    assert refused.value.status_code == 400
    assert refused.value.param == param, refused.value.message


def test_a_logit_bias_and_penalties_steer_the_tokens(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    """A bias of 100 on one token makes greedy decoding choose it every time; a bias of
    -100 on every token the unbiased answer chose keeps each of them out."""
    plain = client.completions.with_raw_response.create(
        model=MODEL, prompt="Ferry queues", max_tokens=6, temperature=0
    )
    chosen = job_of(http, plain.headers["X-Ferry-Job-Id"])["output"]["token_ids"]
    forced = client.completions.with_raw_response.create(
        model=MODEL, prompt="Ferry queues", max_tokens=6, temperature=0, logit_bias={"42": 100}
    )
    job = job_of(http, forced.headers["X-Ferry-Job-Id"])
    assert job["output"]["token_ids"] == [42] * 6
    assert forced.parse().choices[0].text == job["output"]["text"]
    banned = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(t): -100 for t in set(chosen)},
        presence_penalty=1.5,
        frequency_penalty=0.5,
    )
    job = job_of(http, banned.headers["X-Ferry-Job-Id"])
    assert set(job["output"]["token_ids"]).isdisjoint(chosen)


def test_the_model_must_be_a_generation_model_and_the_key_good(
    client: openai.OpenAI, api: Served
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as encoder:
        client.completions.create(model="sim", prompt="x")
    assert "not a generation model" in encoder.value.message
    with (
        openai.OpenAI(base_url=f"{api.base}/v1", api_key="fy_wrong", max_retries=0) as wrong,
        pytest.raises(openai.AuthenticationError),
    ):
        wrong.completions.create(model=MODEL, prompt="x")


def test_a_dropped_stream_does_not_cancel_the_job_unless_asked(
    http: httpx.Client, worker: None
) -> None:
    # Greedy: this prompt runs to its max_tokens (the folder's weights are seeded).
    body = {"model": MODEL, "prompt": "Ferry", "max_tokens": 400, "temperature": 0, "stream": True}
    outcomes = []
    for cancel in (False, True):
        with http.stream(
            "POST", "/v1/completions", json={**body, "ferry_cancel_on_disconnect": cancel}
        ) as response:
            assert response.status_code == 200
            job_id = response.headers["X-Ferry-Job-Id"]
            reader = EventReader(response)
            assert reader.next() is not None  # the first token's chunk: it is running
        found = http.get(f"/v1/jobs/{job_id}", params={"wait": 60}).json()
        outcomes.append((found["status"], found["output"]["finish_reason"]))
    assert outcomes[0] == ("succeeded", "length")
    assert outcomes[1] == ("cancelled", "cancelled")


def test_a_stream_resumed_after_its_last_event_gets_every_token_once(
    http: httpx.Client, worker: None
) -> None:
    answer = http.post(
        "/v1/jobs", json={"model": MODEL, "input": {"prompt": "Ferry", "max_tokens": 48}}
    )
    job_id = answer.json()["id"]
    seen: list[Message] = []
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        reader = EventReader(response)
        while sum(m.event == "token" for m in seen) < 5:
            message = reader.next()
            assert message is not None
            seen.append(message)
    time.sleep(0.2)  # tokens come meanwhile, unread
    with http.stream(
        "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(seen[-1].id)}
    ) as response:
        rest = EventReader(response).all()
    assert rest[0].id is None and rest[0].event == "status"
    assert rest[-1].event == "done" and rest[-1].data["status"] == "succeeded"
    tokens = [m.data for m in seen + rest if m.event == "token"]
    job = job_of(http, job_id)
    assert [t["index"] for t in tokens] == list(range(len(job["output"]["token_ids"])))
    assert [t["token"] for t in tokens] == job["output"]["token_ids"]
    assert "".join(t["text"] for t in tokens) == job["output"]["text"]


def test_a_jobs_logprobs_are_in_its_output_and_its_token_events(
    http: httpx.Client, worker: None
) -> None:
    asked = {"prompt": "Ferry", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    job_id = http.post("/v1/jobs", json={"model": MODEL, "input": asked}).json()["id"]
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        tokens = [m.data for m in EventReader(response).all() if m.event == "token"]
    output = job_of(http, job_id)["output"]
    assert [t["logprob"] for t in tokens] == output["logprobs"]
    assert [e["token"] for e in output["logprobs"]] == output["token_ids"]
    for entry in output["logprobs"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        # Greedy, nothing adjusted: the token chosen is the likeliest.
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    plain = {"prompt": "Ferry", "max_tokens": 2}
    job_id = http.post("/v1/jobs", json={"model": MODEL, "input": plain}).json()["id"]
    assert "logprobs" not in job_of(http, job_id)["output"]


def test_logprobs_through_the_openai_client_streamed_and_not(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    options: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0}
    raw = client.chat.completions.with_raw_response.create(**options, logprobs=True, top_logprobs=3)
    job = job_of(http, raw.headers["X-Ferry-Job-Id"])
    logprobs = raw.parse().choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == job["output"]["usage"]["completion_tokens"]
    for entry, stored in zip(content, job["output"]["logprobs"], strict=True):
        assert (entry.token, entry.logprob) == (stored["text"], stored["logprob"])
        assert entry.bytes == stored["bytes"]  # its own: a byte-level token's, exactly
        assert [t.logprob for t in entry.top_logprobs] == [
            t["logprob"] for t in stored["top_logprobs"]
        ]
        assert len(entry.top_logprobs) == 3
    chunks = list(client.chat.completions.create(**options, stream=True, logprobs=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs 0: the token's alone
    legacy = client.completions.create(
        model=MODEL, prompt="Ferry queues", max_tokens=6, temperature=0, logprobs=2
    )
    found = legacy.choices[0].logprobs
    assert found is not None and found.tokens is not None and found.text_offset is not None
    assert len(found.tokens) == len(found.token_logprobs or []) == 6
    assert all(len(top) <= 2 for top in found.top_logprobs or [])
    lengths = [len(t) for t in found.tokens]
    assert found.text_offset == [sum(lengths[:i]) for i in range(6)]
    pieces = client.completions.create(
        model=MODEL, prompt="Ferry queues", max_tokens=6, temperature=0, logprobs=2, stream=True
    )
    parts = [c.choices[0].logprobs for c in pieces if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens or []] == found.tokens
    assert [o for p in parts for o in p.text_offset or []] == found.text_offset
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="x", logprobs=6)
    assert refused.value.param == "logprobs"


def test_echo_scores_the_prompt_as_lm_eval_asks(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    """lm-evaluation-harness's loglikelihood request (``echo``, ``logprobs: 1``,
    ``max_tokens: 1``; and ``max_tokens: 0``): the prompt's text and each of its tokens'
    logprobs (the first has none), then the generated token's; every position scored
    though an earlier job computed the prompt's blocks (prefix caching passes it by)."""
    prompt = " ".join(["Ferry queues jobs for the models it serves"] * 6)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    ask: dict[str, Any] = {"model": MODEL, "prompt": prompt, "temperature": 0, "echo": True}
    raw = client.completions.with_raw_response.create(**ask, logprobs=1, max_tokens=1)
    output = job_of(http, raw.headers["X-Ferry-Job-Id"])["output"]
    scored = output["prompt_logprobs"]
    assert len(scored) == output["usage"]["prompt_tokens"] > 32
    assert scored[0]["logprob"] is None
    assert all(e["logprob"] is not None and e["logprob"] <= 0 for e in scored[1:])
    choice = raw.parse().choices[0]
    assert choice.text == prompt + output["text"]
    found = choice.logprobs
    assert found is not None and found.token_logprobs is not None and found.top_logprobs
    entries = [*scored, *output["logprobs"]]
    assert found.tokens == [e["text"] for e in entries]
    assert found.token_logprobs == [e["logprob"] for e in entries]
    assert found.top_logprobs[0] is None
    # lm-eval's is_greedy: the token's own logprob is the top one's (greedy, nothing adjusted).
    last = found.top_logprobs[-1]
    assert max(last.values()) == found.token_logprobs[-1]
    alone = client.completions.create(**ask, logprobs=1, max_tokens=0)
    assert alone.choices[0].text == prompt
    assert alone.choices[0].logprobs is not None
    assert alone.choices[0].logprobs.token_logprobs == found.token_logprobs[:-1]
    assert alone.usage is not None and alone.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**ask, max_tokens=2, stream=True)
    assert refused.value.body["param"] == "echo"  # type: ignore[index]


def test_n_choices_are_n_jobs_streamed_and_not(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    """``n: 3`` sampled with a seed: three jobs (seeds 7, 8, 9), three choices, each its
    job's output; the same request streamed gives each choice's text under its index, and
    a replay of an Idempotency-Key finds the same three jobs."""
    ask: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "n": 3}
    ask |= {"temperature": 1.0, "seed": 7}
    raw = client.chat.completions.with_raw_response.create(
        **ask, extra_headers={"Idempotency-Key": "three-choices"}
    )
    ids = raw.headers["X-Ferry-Job-Ids"].split(",")
    assert len(ids) == 3 and raw.headers["X-Ferry-Job-Id"] == ids[0]
    answer = raw.parse()
    jobs = [job_of(http, job_id) for job_id in ids]
    assert [job["output"]["seed"] for job in jobs] == [7, 8, 9]
    assert [job["metadata"]["choice"] for job in jobs] == [0, 1, 2]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    texts = [c.message.content for c in answer.choices]
    assert texts == [job["output"]["text"] for job in jobs]
    assert len(set(texts)) > 1  # sampled from different seeds
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == jobs[0]["output"]["usage"]["prompt_tokens"]
    assert answer.usage.completion_tokens == sum(
        job["output"]["usage"]["completion_tokens"] for job in jobs
    )
    replayed = client.chat.completions.with_raw_response.create(
        **ask, extra_headers={"Idempotency-Key": "three-choices"}
    )
    assert replayed.headers["X-Ferry-Job-Ids"].split(",") == ids
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    streamed = ["", "", ""]
    finished = [None, None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert streamed == texts  # the same seeds, the same tokens
    assert finished == [c.finish_reason for c in answer.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage == answer.usage


def test_token_id_prompts_in_a_list_score_as_lm_eval_sends_them(
    client: openai.OpenAI, http: httpx.Client, worker: None
) -> None:
    """lm-evaluation-harness's default requests: prompts as token ids (nothing added to
    them), several in one request (its batch), each a choice by index; a prompt given as
    the ids its text tokenizes to scores exactly as the text does."""
    texts = ["Ferry queues jobs", "A ferry crosses the river at dawn"]
    ask: dict[str, Any] = {"model": MODEL, "temperature": 0, "echo": True, "logprobs": 1}
    by_text = [client.completions.create(**ask, prompt=t, max_tokens=1) for t in texts]
    raw = client.completions.with_raw_response.create(**ask, prompt=texts, max_tokens=1)
    ids = [
        job_of(http, i)["output"]["prompt_logprobs"]
        for i in raw.headers["X-Ferry-Job-Ids"].split(",")
    ]
    token_ids = [[e["token"] for e in entries] for entries in ids]
    as_ids = client.completions.create(**ask, prompt=token_ids, max_tokens=1)
    together = raw.parse()
    for answers in (together, as_ids):
        assert [c.index for c in answers.choices] == [0, 1]
        for choice, alone in zip(answers.choices, by_text, strict=True):
            assert choice.logprobs is not None and alone.choices[0].logprobs is not None
            found, expected = choice.logprobs, alone.choices[0].logprobs
            assert found.tokens == expected.tokens
            assert found.token_logprobs == pytest.approx(expected.token_logprobs, abs=1e-4)
    assert as_ids.usage is not None and together.usage is not None
    assert as_ids.usage.prompt_tokens == sum(len(t) for t in token_ids)
    assert together.usage.prompt_tokens == as_ids.usage.prompt_tokens
    # Ids without the tokenizer's first token: taken as they are, scored from the second.
    cut = client.completions.create(**ask, prompt=token_ids[0][1:], max_tokens=0)
    assert cut.choices[0].logprobs is not None
    assert len(cut.choices[0].logprobs.token_logprobs or []) == len(token_ids[0]) - 1
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**ask, prompt=[[1, 2], [10**7]], max_tokens=1)
    assert refused.value.param == "prompt[1][0]"
    # A token that decodes to NUL (the byte-level vocabulary's byte 0) runs as given; the
    # text stored beside the ids, which PostgreSQL's text cannot hold a NUL of, has none.
    tokenizer = Tokenizer.from_file(str(lm_folder("llama") / "tokenizer.json"))
    nul = next(i for i in range(tokenizer.get_vocab_size()) if tokenizer.decode([i]) == "\x00")
    raw = client.completions.with_raw_response.create(
        **ask, prompt=[nul, *token_ids[0][1:]], max_tokens=1
    )
    job = job_of(http, raw.headers["X-Ferry-Job-Id"])
    assert job["output"]["prompt_logprobs"][0]["token"] == nul
    assert raw.parse().choices[0].text.startswith("\ufffd")


def test_a_request_whose_choices_are_not_all_admitted_is_refused_whole(
    gen_settings: Settings, auth: dict[str, str], token: str
) -> None:
    """Room in the key's quota for 4 jobs, 1 taken: a request for 4 choices is a 429, and
    the 3 jobs admitted before the refusal are taken back at once (nothing runs that no
    one asked for, the quota is whole again, the request's idempotency key free); a
    request for more jobs than the quota could ever hold is refused as such."""
    with served(gen_settings, max_outstanding_jobs=4) as capped:
        body = {"model": MODEL, "input": {"prompt": "Ferry", "max_tokens": 2}}
        with webclient.client(base_url=capped.base, headers=auth, timeout=30) as http:
            assert http.post("/v1/jobs", json=body).status_code == 202
        client = openai.OpenAI(base_url=f"{capped.base}/v1", api_key=token, max_retries=0)
        with client:
            with pytest.raises(openai.RateLimitError):
                client.completions.create(
                    model=MODEL, prompt="Ferry", max_tokens=2, n=4,
                    extra_headers={"Idempotency-Key": "four"},
                )  # fmt: skip
            with pytest.raises(openai.BadRequestError) as never:
                client.completions.create(model=MODEL, prompt="Ferry", max_tokens=2, n=5)
            assert never.value.param == "n"
        with webclient.client(base_url=capped.base, headers=auth, timeout=30) as http:
            assert len(http.get("/v1/jobs", params={"limit": 50}).json()["data"]) == 1
            again = http.post("/v1/jobs", json=body, headers={"Idempotency-Key": "four"})
            assert again.status_code == 202 and "Idempotent-Replayed" not in again.headers
            assert [http.post("/v1/jobs", json=body).status_code for _ in range(2)] == [202] * 2
            assert http.post("/v1/jobs", json=body).status_code == 429


def test_a_batch_of_chat_lines_has_one_output_line_per_line(
    client: openai.OpenAI,
    http: httpx.Client,
    worker: None,
    gen_settings: Settings,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    lines = [
        {
            "custom_id": f"chat-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Question {n}"}],
                "max_tokens": 4 + n,
                "temperature": 0,
            }
            # Every other line asks for its tokens' logprobs (an evaluation's usual batch).
            | ({"logprobs": True, "top_logprobs": 2} if n % 2 else {}),
        }
        for n in range(6)
    ]
    raw = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("chat.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.model == MODEL
    with RunningFeeder(make_feeder(sessions, redis_client, gen_settings)):
        until = time.monotonic() + 180
        while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            assert time.monotonic() < until, f"batch still {batch.status}"
            time.sleep(0.2)
    assert batch.status == "completed" and batch.error_file_id is None
    assert batch.output_file_id is not None
    content = client.files.content(batch.output_file_id).content.decode()
    output = [json.loads(line) for line in content.splitlines()]
    assert [line["custom_id"] for line in output] == [f"chat-{n}" for n in range(6)]
    made = 0
    for n, line in enumerate(output):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        job = job_of(http, line["response"]["request_id"])
        assert body["choices"][0]["message"]["content"] == job["output"]["text"]
        assert body["usage"] == job["output"]["usage"]
        assert body["usage"]["completion_tokens"] <= 4 + n
        made += body["usage"]["completion_tokens"]
        logprobs = body["choices"][0]["logprobs"]
        if n % 2:
            assert [e["logprob"] for e in logprobs["content"]] == [
                e["logprob"] for e in job["output"]["logprobs"]
            ]
            assert all(len(e["top_logprobs"]) == 2 for e in logprobs["content"])
        else:
            assert logprobs is None
    assert batch.usage is not None and batch.usage.output_tokens == made


def test_a_bad_chat_line_fails_the_batch_naming_it(client: openai.OpenAI) -> None:
    good = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": CHAT},
    }
    bad = {**good, "custom_id": "b", "body": {**good["body"], "top_logprobs": 3}}  # type: ignore[dict-item]
    raw = "".join(json.dumps(line) + "\n" for line in (good, bad)).encode()
    uploaded = client.files.create(file=("chat.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.errors is not None
    (error,) = batch.errors.data or []
    assert (error.line, error.param) == (2, "body.top_logprobs")


def test_a_batch_of_chat_lines_counts_lines_as_they_finish_and_a_cancel_keeps_them(
    settings: Settings,
    tmp_path: Path,
    token: str,
    sessions: sessionmaker[Session],
    redis_client: redis.Redis,
) -> None:
    # Two slots, no end-of-sequence token: eight lines of 40 tokens finish two by two.
    slow = generation_settings(settings, tmp_path / "slow", max_running=2, eos=False)
    lines = [
        {
            "custom_id": f"line-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Q{n}"}],
                "max_tokens": 40,
                "temperature": 0,
            },
        }
        for n in range(8)
    ]
    raw = "".join(json.dumps(line) + "\n" for line in lines).encode()
    running = start_worker(slow, "batch-progress-worker")
    slow_steps(running, 0.02)  # 40 steps of at least 20 ms a pair of lines
    seen: list[int] = []
    with (
        served(slow) as api,
        openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client,
    ):
        uploaded = client.files.create(file=("chat.jsonl", io.BytesIO(raw)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with running, RunningFeeder(make_feeder(sessions, redis_client, slow)):
            until = time.monotonic() + 120
            while True:
                batch = client.batches.retrieve(batch.id)
                assert batch.request_counts is not None
                seen.append(batch.request_counts.completed)
                if batch.request_counts.completed >= 2 or batch.status != "in_progress":
                    break
                assert time.monotonic() < until, "no line finished"
                time.sleep(0.05)
            assert batch.status == "in_progress", batch  # counted while the batch runs
            client.batches.cancel(batch.id)
            until = time.monotonic() + 120
            while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
                assert time.monotonic() < until, f"batch still {batch.status}"
                time.sleep(0.1)
        assert batch.request_counts is not None
        counts = batch.request_counts
        assert counts.total == 8 and counts.completed + counts.failed == 8
        assert seen == sorted(seen) and counts.completed >= seen[-1] >= 2  # lines kept
        assert counts.completed < 8  # the cancel came mid-run
        assert batch.output_file_id is not None and batch.error_file_id is not None
        finished = [
            json.loads(line)
            for line in client.files.content(batch.output_file_id).text.splitlines()
        ]
        errors = [
            json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()
        ]
    assert len(finished) == counts.completed and len(errors) == counts.failed
    for line in finished:
        body = line["response"]["body"]
        assert line["error"] is None and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == 40
    ids = sorted(line["custom_id"] for line in finished + errors)
    assert ids == sorted(f"line-{n}" for n in range(8))
