"""POST /v1/jobs with a generation input: refused naming the member, or stored normalised.

The model's spec is built from a repository folder written here and put in
the app's catalog, so nothing needs the causal-lm backend.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.state import app_state
from core.config.settings import Settings
from core.db.schema import Job
from core.models.reader import load_repository
from tests.causal_lm_files import catalog_spec, write_model
from tests.models import REPOSITORY


@pytest.fixture
def client(settings: Settings, tmp_path: Path) -> Iterator[TestClient]:
    root = tmp_path / "repository"
    shutil.copytree(REPOSITORY / "sim", root / "sim")
    write_model(root, "tiny-lm", context_tokens=64)
    changed = settings.model_copy(
        update={"model_repository": root, "models": "sim", "model_parameters": {}}
    )
    with TestClient(create_app(changed)) as test_client:
        model = load_repository(root, environ={})["tiny-lm"]
        app_state(test_client.app).catalog["tiny-lm"] = catalog_spec(model)
        yield test_client


def submit(client: TestClient, auth: dict[str, str], value: Any) -> Any:
    return client.post("/v1/jobs", json={"model": "tiny-lm", "input": value}, headers=auth)


def test_messages_are_stored_as_the_prompt_they_render(
    client: TestClient, auth: dict[str, str], sessions: sessionmaker[Session]
) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    answer = submit(client, auth, {"messages": messages, "max_tokens": 10, "seed": 7})
    assert answer.status_code == 202, answer.text
    with sessions() as session:
        job = session.scalars(select(Job).where(Job.id == answer.json()["id"])).one()
    prompt = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert job.input == {
        "prompt": prompt,
        "messages": messages,
        "max_tokens": 10,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
        "seed": 7,
        "prompt_tokens": 7,  # <|im_start|> user hello world <|im_end|> <|im_start|> assistant
    }
    assert job.cost == 7 + 10
    assert answer.json()["status"] == "queued"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            {"prompt": "cat " * 39, "max_tokens": 5000},
            "max_tokens: is 5000: the prompt's 40 tokens and 5000 leave no room in the "
            "model's context of 64 tokens (at most 24 here)",
        ),
        (
            {"prompt": "cat " * 70},
            "prompt: the prompt has 71 tokens, longer than the context of 64",
        ),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
            "messages[1].role: is 'tool': tool messages are not taken",
        ),
        ({"prompt": "a", "temperature": True}, "temperature: must be a number, got boolean"),
        ({"prompt": "a", "best_of": 2}, "best_of: is not a field of generation inputs"),
    ],
)
def test_a_refusal_is_a_422_naming_the_member(
    client: TestClient,
    auth: dict[str, str],
    sessions: sessionmaker[Session],
    value: Any,
    message: str,
) -> None:
    answer = submit(client, auth, value)
    assert answer.status_code == 422
    assert answer.json()["error"]["message"].startswith(message), answer.json()
    with sessions() as session:
        assert session.scalars(select(Job)).all() == []
