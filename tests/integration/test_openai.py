"""POST /v1/embeddings through the real ``openai`` package, on a real minilm worker."""

from __future__ import annotations

import base64
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db.schema import Job
from core.models.inputs import count_tokens
from harness import webclient
from harness.served import Served, served
from tests.integration.conftest import RunningLoop
from tests.vectors import cosine
from workers.gpu.main import build_loop

# The database is not this module's subject: it runs on PostgreSQL only (both
# databases are the subject of the job path's own tests).
pytestmark = pytest.mark.one_database("postgresql")


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [f"sentence number {n} is about {'cats' if n % 2 else 'trains'}" for n in range(100)]


@pytest.fixture
def minilm(settings: Settings) -> Iterator[None]:
    with RunningLoop(build_loop(settings, "minilm", name="openai-test")):
        yield


@pytest.fixture
def client(api: Served, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client:
        yield client


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_one_string(client: openai.OpenAI, minilm: None, settings: Settings) -> None:
    text = "A cat sits on the mat."
    answer = client.embeddings.create(model="minilm", input=text)
    assert answer.object == "list" and answer.model == "minilm"
    (item,) = answer.data
    assert item.index == 0 and len(item.embedding) == 384
    assert norm(item.embedding) == pytest.approx(1.0, abs=1e-4)
    tokenizer = build_catalog(settings)["minilm"].input.tokenizer  # the model's own
    assert answer.usage.prompt_tokens == count_tokens(text, tokenizer) > 2
    assert answer.usage.total_tokens == answer.usage.prompt_tokens
    near = client.embeddings.create(model="minilm", input="A kitten rests on a rug.")
    far = client.embeddings.create(model="minilm", input="Quarterly tax filing deadlines.")
    assert cosine(item.embedding, near.data[0].embedding) > cosine(
        item.embedding, far.data[0].embedding
    )


def test_a_list_of_a_hundred_comes_back_in_order(
    client: openai.OpenAI,
    minilm: None,
    texts: list[str],
    sessions: sessionmaker[Session],
) -> None:
    answer = client.embeddings.create(
        model="minilm", input=texts, extra_headers={"X-Ferry-Priority": "vip"}
    )
    assert [item.index for item in answer.data] == list(range(100))
    alone = client.embeddings.create(model="minilm", input=texts[7]).data[0].embedding
    assert cosine(answer.data[7].embedding, alone) > 0.9999
    assert cosine(answer.data[7].embedding, answer.data[8].embedding) < 0.9999
    with sessions() as session:
        jobs = session.scalars(select(Job).where(Job.priority == "vip")).all()
    # Each text was a job of its own, in the lane the header asked for, spread over batches.
    assert len(jobs) == 100 and {job.status for job in jobs} == {"succeeded"}
    assert len({job.batch_id for job in jobs}) > 1


def test_base64_is_little_endian_float32(client: openai.OpenAI, minilm: None) -> None:
    text = "Trains leave on the hour."
    floats = client.embeddings.create(model="minilm", input=text, encoding_format="float")
    raw = client.embeddings.create(model="minilm", input=text, encoding_format="base64")
    encoded = raw.data[0].embedding
    assert isinstance(encoded, str)
    decoded = struct.unpack("<384f", base64.b64decode(encoded))
    assert list(decoded) == pytest.approx(floats.data[0].embedding, abs=1e-6)


def test_a_model_that_is_not_there_or_gives_no_vectors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as wrong:
        client.embeddings.create(model="sim", input="x")
    assert wrong.value.param == "model" and "does not produce embeddings" in wrong.value.message
    with pytest.raises(openai.BadRequestError) as shorter:
        client.embeddings.create(model="minilm", input="x", dimensions=64)
    assert shorter.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as nul:  # a 400, not a 500
        client.embeddings.create(model="minilm", input=["fine", "a\u0000b"])
    assert nul.value.param == "input[1]" and "NUL" in nul.value.message


def test_a_missing_or_wrong_key_is_refused(api: Served) -> None:
    with (
        openai.OpenAI(base_url=f"{api.base}/v1", api_key="fy_wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError) as refused,
    ):
        client.embeddings.create(model="minilm", input="x")
    assert refused.value.status_code == 401
    bare = webclient.post(f"{api.base}/v1/embeddings", json={"model": "minilm", "input": "x"})
    assert bare.status_code == 401
    error = bare.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"


def test_an_oversized_list_is_refused_whole(
    client: openai.OpenAI, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    too_many = ["x"] * (settings.embeddings_max_inputs + 1)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="minilm", input=too_many)
    assert refused.value.param == "input" and "at most 2048" in refused.value.message
    with pytest.raises(openai.BadRequestError) as blank:
        client.embeddings.create(model="minilm", input=["fine", "   "])
    assert blank.value.param == "input[1]"
    with sessions() as session:
        assert session.scalars(select(Job)).all() == []  # nothing of either was kept


def test_shorter_vectors_where_the_model_allows_them(
    settings: Settings, token: str, tmp_path: Path, sessions: sessionmaker[Session]
) -> None:
    """A model whose model.toml says `truncatable` gives vectors of the length asked, cut
    and normalised again as OpenAI's shortened embeddings are; `user` is kept with the job."""
    root = tmp_path / "models"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "minilm", root / "minilm")
    toml = root / "minilm" / "model.toml"
    toml.write_text(toml.read_text() + "truncatable = true\n")
    shorter = settings.model_copy(
        update={"model_repository": root, "models": "minilm", "model_parameters": {}}
    )
    text = "A cat sits on the mat."
    with (
        served(shorter) as api,
        RunningLoop(build_loop(shorter, "minilm", name="openai-dimensions")),
        openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client,
    ):
        whole = client.embeddings.create(model="minilm", input=text).data[0].embedding
        cut = (
            client.embeddings.create(model="minilm", input=text, dimensions=64, user="team-a")
            .data[0]
            .embedding
        )
        with pytest.raises(openai.BadRequestError) as longer:
            client.embeddings.create(model="minilm", input=text, dimensions=385)
    assert len(whole) == 384 and len(cut) == 64
    assert norm(cut) == pytest.approx(1.0, abs=1e-4)
    head = norm(whole[:64])
    assert cut == pytest.approx([x / head for x in whole[:64]], abs=1e-5)
    assert longer.value.param == "dimensions" and "at most 384" in longer.value.message
    with sessions() as session:
        kept = [job.metadata_ for job in session.scalars(select(Job)).all()]
    assert {"openai": "embeddings", "user": "team-a"} in kept
    assert {"openai": "embeddings"} in kept  # no user: none kept
