"""GET /v1/models and /v1/models/{id} through the real ``openai`` package, on a real app."""

from __future__ import annotations

import datetime as dt
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from sqlalchemy.orm import Session, sessionmaker

from api.state import app_state
from backends.catalog import build_catalog
from core.config.settings import Settings
from core.db.schema import ModelActivation
from core.models.reader import load_repository
from harness import webclient
from harness.served import Served, served
from tests.causal_lm_files import catalog_spec, write_model
from tests.models import REPOSITORY


@pytest.fixture
def client(api: Served, token: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client:
        yield client


def test_the_list_holds_every_model_in_openais_shape(
    client: openai.OpenAI, settings: Settings
) -> None:
    # The shipped tiny generation models join the catalog once their files are built
    # (their first start); the encoders are always there.
    models = {m.id: m for m in client.models.list() if not m.id.startswith("tiny-")}
    served = set(build_catalog(settings))
    assert {m.id for m in client.models.list()} == served
    assert set(models) == served - {"tiny-gpt2", "tiny-llama"} == {"minilm", "resnet50", "sim"}
    for name, model in models.items():
        assert (model.object, model.owned_by) == ("model", "ferry")
        # Ferry's own fields are kept beside OpenAI's.
        extra = model.model_extra or {}
        assert extra["name"] == name and extra["version"] == 1
        assert extra["queue_depth"] == {"urgent": 0, "vip": 0, "normal": 0, "bulk": 0}
        toml = settings.model_repository_path / name / "model.toml"
        assert model.created == int(toml.stat().st_mtime)
    kinds = {name: (m.model_extra or {})["kind"] for name, m in models.items()}
    assert kinds == {"minilm": "text", "resnet50": "image", "sim": "json"}
    assert all((m.model_extra or {})["generation"] is None for m in models.values())


def test_retrieve_one_and_an_unknown_one(client: openai.OpenAI, api: Served, token: str) -> None:
    minilm = client.models.retrieve("minilm")
    assert (minilm.id, minilm.object, minilm.owned_by) == ("minilm", "model", "ferry")
    listed = next(m for m in client.models.list() if m.id == "minilm")
    assert minilm.model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    assert "unknown model 'gpt-4o'" in missing.value.message
    # The same body to a plain client: OpenAI's error object, its type and message too.
    answer = webclient.get(
        f"{api.base}/v1/models/gpt-4o", headers={"Authorization": f"Bearer {token}"}
    )
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert answer.json()["error"]["param"] == "model"


def test_a_missing_key_is_refused(api: Served) -> None:
    with (
        openai.OpenAI(base_url=f"{api.base}/v1", api_key="fy_wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.retrieve("minilm")


def test_created_is_when_the_active_version_was_activated(
    client: openai.OpenAI, sessions: sessionmaker[Session]
) -> None:
    when = dt.datetime(2025, 3, 4, 5, 6, 7, tzinfo=dt.UTC)
    with sessions() as session:
        session.add(ModelActivation(model="sim", version=1, updated_at=when))
        # An activation of a version the repository lacks is not the active one.
        session.add(ModelActivation(model="minilm", version=9, updated_at=when))
        session.commit()
    assert client.models.retrieve("sim").created == int(when.timestamp())
    listed = {m.id: m.created for m in client.models.list()}
    assert listed["sim"] == int(when.timestamp())
    assert listed["minilm"] != int(when.timestamp())


def test_a_generation_model_says_its_context(
    settings: Settings, token: str, tmp_path: Path
) -> None:
    root = tmp_path / "repository"
    shutil.copytree(REPOSITORY / "sim", root / "sim")
    write_model(root, "tiny-lm", "default_max_tokens = 16", context_tokens=128)
    write_model(root, "plain-lm", "context_tokens = 32", chat_template=None, context_tokens=None)
    changed = settings.model_copy(
        update={"model_repository": root, "models": "sim", "model_parameters": {}}
    )
    repository = load_repository(root, environ={})
    with served(changed) as api:
        # Its spec as the catalog builds it: the API must not need the backend to describe it.
        for name in ("tiny-lm", "plain-lm"):
            app_state(api.app).catalog[name] = catalog_spec(repository[name])
        with openai.OpenAI(base_url=f"{api.base}/v1", api_key=token, max_retries=0) as client:
            tiny = client.models.retrieve("tiny-lm").model_extra or {}
            plain = next(m for m in client.models.list() if m.id == "plain-lm").model_extra or {}
    assert tiny["kind"] == "generation" and tiny["backend"] == "causal-lm"
    assert tiny["generation"] == {
        "context_tokens": 128,
        "default_max_tokens": 16,
        "chat": True,
        "execution": None,
        "why": None,
        "prefix_caching": None,
        "step_fixed_ms": None,
        "step_per_token_ms": None,
    }
    assert plain["generation"] == {
        "context_tokens": 32,
        "default_max_tokens": 256,
        "chat": False,
        "execution": None,
        "why": None,
        "prefix_caching": None,
        "step_fixed_ms": None,
        "step_per_token_ms": None,
    }
    assert "messages" in tiny["input_schema"]["properties"]
    assert "messages" not in plain["input_schema"]["properties"]
