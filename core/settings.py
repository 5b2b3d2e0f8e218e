"""One typed settings object for every Ferry process.

Every field is read from the environment with the ``FERRY_`` prefix (for example
``FERRY_API_PORT``). Build it with :func:`get_settings`, never at import time, so
tests and the ``ferry`` tool can set the environment first.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LANES = ("urgent", "vip", "normal", "bulk")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FERRY_", extra="ignore")

    # Where Ferry keeps its local state: the SQLite file, the embedded Redis.
    data_dir: Path = Path(".ferry")

    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    # Unset: `ferry up` starts its own redis-server with its data under data_dir.
    redis_url: str | None = None
    # Unset: a SQLite file under data_dir. PostgreSQL: postgresql+psycopg://...
    database_url: str | None = None
    # Every Redis key Ferry writes starts with this, so several deployments (or
    # test runs) can share one Redis.
    key_prefix: str = Field("ferry", pattern=r"^[A-Za-z0-9_.-]+$")

    # Models that `ferry up` starts a worker for, comma-separated.
    models: str = "minilm,sim"

    # Batching (the first, simple policy).
    batch_max_size: int = Field(32, ge=1, le=4096)
    batch_window_ms: float = Field(10.0, ge=0)
    prefetch: int = Field(128, ge=1)
    max_attempts: int = Field(3, ge=1)

    # The API.
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_wait_s: float = Field(30.0, ge=0)
    docs_enabled: bool = True

    # Retention: Celery beat purges terminal jobs older than this.
    result_ttl_s: float = Field(7 * 24 * 3600.0, gt=0)
    purge_interval_s: float = Field(3600.0, gt=0)

    # Workers.
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    minilm_max_tokens: int = Field(256, ge=8, le=512)
    minilm_max_chars: int = Field(20_000, ge=1)
    minilm_overlength: Literal["truncate", "refuse"] = "truncate"
    sim_latency_base_ms: float = Field(20.0, ge=0)
    sim_latency_per_cost_ms: float = Field(0.5, ge=0)
    sim_memory_base_bytes: int = Field(64 * 2**20, ge=0)
    sim_memory_per_cost_bytes: int = Field(2**20, ge=0)
    sim_max_cost: int = Field(4096, ge=1)

    log_level: str = "INFO"

    @field_validator("redis_url", "database_url", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @property
    def model_names(self) -> list[str]:
        return [name.strip() for name in self.models.split(",") if name.strip()]

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'ferry.db').resolve()}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
