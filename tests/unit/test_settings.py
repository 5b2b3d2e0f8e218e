"""The one settings object, read from FERRY_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsError

from api.oip.grpc import GrpcSettings
from api.state import ApiSettings
from core.config.settings import Settings, get_settings
from core.db.schema import DatabaseSettings
from core.ops.metrics import AutoscaleSettings
from core.streams.target import RedisSettings
from workers.gpu.loop import LoopConfig
from workers.gpu.scheduling import BatchingSettings
from workers.tasks.webhooks import WebhookSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No FERRY_* variable from the caller's shell leaks into a test."""
    for name in list(os.environ):
        if name.upper().startswith("FERRY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def test_defaults(tmp_path: Path) -> None:
    settings = Settings()
    assert settings.api_port == 8000
    assert settings.api_host == "127.0.0.1"
    assert settings.redis_url is None
    assert settings.database_url is None
    assert settings.key_prefix == "ferry"
    assert settings.data_dir == Path(".ferry")
    assert settings.model_names == ["minilm", "sim"]
    # No ./models here: the repository that ships beside Ferry's code.
    assert settings.model_repository is None
    assert settings.model_repository_path == Path(__file__).resolve().parents[2] / "models"
    assert settings.sqlalchemy_url == f"sqlite:///{tmp_path.resolve() / '.ferry' / 'ferry.db'}"


@pytest.mark.parametrize(
    ("env", "field", "expected"),
    [
        ({"FERRY_API_PORT": "9123"}, "api_port", 9123),
        ({"FERRY_API_HOST": "0.0.0.0"}, "api_host", "0.0.0.0"),
        ({"FERRY_REDIS_URL": "redis://h:6380/2"}, "redis_url", "redis://h:6380/2"),
        ({"FERRY_KEY_PREFIX": "test-run.1"}, "key_prefix", "test-run.1"),
        ({"FERRY_BATCH_MAX_SIZE": "64"}, "batch_max_size", 64),
        ({"FERRY_BATCH_WINDOW_MAX_MS": "2.5"}, "batch_window_max_ms", 2.5),
        ({"FERRY_BATCH_MAX_COST": "8192"}, "batch_max_cost", 8192),
        ({"FERRY_SCHEDULER": "fixed"}, "scheduler", "fixed"),
        ({"FERRY_MEMORY_THRESHOLD": "0.5"}, "memory_threshold", 0.5),
        ({"FERRY_DOCS_ENABLED": "false"}, "docs_enabled", False),
        ({"FERRY_MODEL_REPOSITORY": "/srv/models"}, "model_repository", Path("/srv/models")),
        (
            {"FERRY_MODEL_PARAMETERS": '{"sim": {"latency_base_ms": 5}}'},
            "model_parameters",
            {"sim": {"latency_base_ms": 5}},
        ),
        ({"FERRY_DATA_DIR": "/var/lib/ferry"}, "data_dir", Path("/var/lib/ferry")),
        ({"ferry_api_port": "9001"}, "api_port", 9001),  # case-insensitive
    ],
)
def test_environment_is_read(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], field: str, expected: object
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert getattr(Settings(), field) == expected


def test_unprefixed_variables_are_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("API_PORT", "1234")
    monkeypatch.setenv("REDIS_URL", "redis://elsewhere")
    settings = Settings()
    assert settings.api_port == 8000
    assert settings.redis_url is None


@pytest.mark.parametrize("name", ["FERRY_REDIS_URL", "FERRY_DATABASE_URL"])
def test_empty_url_means_unset(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "")
    settings = Settings()
    assert settings.redis_url is None
    assert settings.database_url is None


def test_sqlite_url_under_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_DATA_DIR", str(tmp_path / "state"))
    assert Settings().sqlalchemy_url == f"sqlite:///{tmp_path.resolve() / 'state' / 'ferry.db'}"


def test_database_url_wins_over_data_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://ferry:pw@db/ferry"
    monkeypatch.setenv("FERRY_DATABASE_URL", url)
    monkeypatch.setenv("FERRY_DATA_DIR", "/somewhere")
    assert Settings().sqlalchemy_url == url


@pytest.mark.parametrize(
    ("models", "expected"),
    [
        ("minilm,sim", ["minilm", "sim"]),
        ("sim", ["sim"]),
        (" minilm , sim ", ["minilm", "sim"]),
        ("minilm,,sim,", ["minilm", "sim"]),
        ("", []),
        (" , ", []),
    ],
)
def test_model_names(monkeypatch: pytest.MonkeyPatch, models: str, expected: list[str]) -> None:
    monkeypatch.setenv("FERRY_MODELS", models)
    assert Settings().model_names == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FERRY_API_PORT", "0"),
        ("FERRY_API_PORT", "65536"),
        ("FERRY_API_PORT", "-1"),
        ("FERRY_API_PORT", "http"),
        ("FERRY_KEY_PREFIX", "has space"),
        ("FERRY_KEY_PREFIX", "a:b"),
        ("FERRY_KEY_PREFIX", ""),
        ("FERRY_KEY_PREFIX", "a{b}"),  # would break the {model} hash tag
        ("FERRY_BATCH_MAX_SIZE", "0"),
        ("FERRY_BATCH_WINDOW_MAX_MS", "-1"),
        ("FERRY_SCHEDULER", "fifo"),
        ("FERRY_MEMORY_THRESHOLD", "0"),
        ("FERRY_MEMORY_THRESHOLD", "1.5"),
        ("FERRY_BULK_SHARE", "1"),
        ("FERRY_BATCH_MAX_COST", "0"),
        ("FERRY_MODEL_SETTINGS", '{"minilm": {"api_port": 1}}'),
        ("FERRY_MODEL_SETTINGS", '{"minilm": {"batch_max_size": 0}}'),
        ("FERRY_MODEL_PARAMETERS", '["sim"]'),
        ("FERRY_RESULT_TTL_S", "0"),
        ("FERRY_FLOWER_PASSWORD", "a,b"),  # Flower reads a comma as another user
        ("FERRY_FLOWER_USER", "a:b"),
        ("FERRY_FLOWER_PORT", "65536"),
    ],
)
def test_invalid_values_are_rejected(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        Settings()


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_are_inclusive(monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    monkeypatch.setenv("FERRY_API_PORT", str(port))
    assert Settings().api_port == port


def test_get_settings_is_cached_and_built_on_call(monkeypatch: pytest.MonkeyPatch) -> None:
    get_settings.cache_clear()
    try:
        monkeypatch.setenv("FERRY_API_PORT", "8123")
        first = get_settings()
        monkeypatch.setenv("FERRY_API_PORT", "8124")
        assert get_settings() is first
        assert first.api_port == 8123
    finally:
        get_settings.cache_clear()


def test_model_settings_override_only_their_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_BATCH_MAX_SIZE", "16")
    monkeypatch.setenv(
        "FERRY_MODEL_SETTINGS", '{"minilm": {"batch_max_size": 64, "batch_max_cost": 8192}}'
    )
    settings = Settings()
    minilm, sim = settings.for_model("minilm"), settings.for_model("sim")
    assert (minilm.tuning.batch_max_size, minilm.tuning.batch_max_cost) == (64, 8192)
    assert (sim.tuning.batch_max_size, sim.tuning.batch_max_cost) == (16, None)
    assert settings.tuning.batch_max_size == 16  # the shared settings are untouched


def test_a_models_own_settings_give_way_to_explicit_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # model.toml's [batching] replaces Ferry's defaults, not what the operator set.
    from_file = {"batch_max_size": 64, "batch_window_max_ms": 7.0, "precision": "bf16"}
    plain = Settings().for_model("m", from_file)
    assert (plain.tuning.batch_max_size, plain.tuning.batch_window_max_ms) == (64, 7.0)
    assert plain.precision == "bf16"
    monkeypatch.setenv("FERRY_BATCH_MAX_SIZE", "16")
    monkeypatch.setenv("FERRY_MODEL_SETTINGS", '{"m": {"batch_window_max_ms": 3.0}}')
    explicit = Settings().for_model("m", from_file)
    assert (explicit.tuning.batch_max_size, explicit.tuning.batch_window_max_ms) == (16, 3.0)
    assert explicit.precision == "bf16"


def test_window_bounds_must_be_ordered() -> None:
    with pytest.raises(ValidationError, match="batch_window_min_ms"):
        Settings(batch_window_min_ms=30.0, batch_window_max_ms=10.0)


def test_model_settings_must_be_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_MODEL_SETTINGS", "batch_max_size=64")
    with pytest.raises(SettingsError, match="model_settings"):
        Settings()


@dataclass(frozen=True)
class _Hooks:
    SETTINGS_PREFIX: ClassVar[str] = "webhook_"
    timeout_s: float
    allow_http: bool


def test_a_section_takes_each_field_from_the_setting_of_its_name() -> None:
    settings = Settings(webhook_timeout_s=7.5, webhook_allow_http=True, data_dir=Path("d"))
    assert settings.section(_Hooks) == _Hooks(timeout_s=7.5, allow_http=True)

    @dataclass(frozen=True)
    class Where:
        key_prefix: str
        sqlalchemy_url: str  # a property of the settings, derived from data_dir

    where = settings.section(Where)
    assert where.key_prefix == "ferry"
    assert where.sqlalchemy_url == f"sqlite:///{(Path('d') / 'ferry.db').resolve()}"


def test_a_section_field_that_names_no_setting_is_said_at_once() -> None:
    @dataclass(frozen=True)
    class Wrong:
        SETTINGS_PREFIX: ClassVar[str] = "webhook_"
        timeout_ms: float

    missing = r"Wrong\.timeout_ms: there is no setting webhook_timeout_ms"
    with pytest.raises(TypeError, match=missing):
        Settings().section(Wrong)


@pytest.mark.parametrize(
    "section",
    [
        ApiSettings, AutoscaleSettings, BatchingSettings, DatabaseSettings, GrpcSettings,
        LoopConfig, RedisSettings, WebhookSettings,
    ],
)  # fmt: skip
def test_each_components_section_is_filled_from_the_settings(section: type[Any]) -> None:
    settings = Settings(redis_url="redis://127.0.0.1:6379/0", metrics_token="t")
    built = settings.section(section)
    prefix = getattr(section, "SETTINGS_PREFIX", "")
    for field in fields(section):
        assert getattr(built, field.name) == getattr(settings, prefix + field.name), field.name
