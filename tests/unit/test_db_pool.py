"""Each process's database pool is sized by FERRY_DB_POOL_SIZE and FERRY_DB_POOL_OVERFLOW."""

from __future__ import annotations

import pytest
from sqlalchemy.pool import QueuePool

from core.config.settings import DB_POOL_OVERFLOW, DB_POOL_SIZE, Settings
from core.db.schema import DatabaseSettings, engine_for, make_engine

URLS = ("postgresql+psycopg://ferry@127.0.0.1:1/ferry", "sqlite:///ferry.db")


@pytest.mark.parametrize("url", URLS)
def test_the_settings_size_the_pool(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_DB_POOL_SIZE", "3")
    monkeypatch.setenv("FERRY_DB_POOL_OVERFLOW", "4")
    # No connection is opened.
    engine = engine_for(Settings(database_url=url).section(DatabaseSettings))
    try:
        assert isinstance(engine.pool, QueuePool)
        assert (engine.pool.size(), engine.pool._max_overflow) == (3, 4)
    finally:
        engine.dispose()


@pytest.mark.parametrize("url", URLS)
def test_an_engine_made_without_settings_has_the_settings_defaults(url: str) -> None:
    engine = make_engine(url)
    settings = Settings()
    try:
        assert isinstance(engine.pool, QueuePool)
        assert engine.pool.size() == DB_POOL_SIZE == settings.db_pool_size
        assert engine.pool._max_overflow == DB_POOL_OVERFLOW == settings.db_pool_overflow
    finally:
        engine.dispose()
