"""The schema exists only through Alembic, on SQLite and PostgreSQL alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import inspect, select, text
from sqlalchemy.orm import Session

from core.db import migrate
from core.db.keys import create_key
from core.db.schema import ApiKey, Base, make_engine
from tests.conftest import run_ferry


def test_head_matches_the_models_and_downgrades_cleanly(database_url: str) -> None:
    engine = make_engine(database_url)
    try:
        inspector = inspect(engine)
        for table in Base.metadata.sorted_tables:
            columns = {c["name"] for c in inspector.get_columns(table.name)}
            assert columns == set(table.columns.keys()), table.name
        indexes = {i["name"] for i in inspector.get_indexes("jobs")}
        assert {"ix_jobs_key_created", "ix_jobs_status_finished"} <= indexes

        command.downgrade(migrate.alembic_config(database_url), "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    finally:
        migrate.upgrade(database_url)  # leave it as the session found it
    try:
        assert {"jobs", "api_keys"} <= set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_a_jobs_key_is_a_foreign_key_on_sqlite_only(database_url: str) -> None:
    """PostgreSQL's check of it locked the key's row for each job inserted (0014)."""
    engine = make_engine(database_url)
    checked = engine.dialect.name != "postgresql"

    def key_constraints() -> list[Any]:
        return [
            fk
            for fk in inspect(engine).get_foreign_keys("jobs")
            if fk["constrained_columns"] == ["api_key_id"]
        ]

    try:
        assert bool(key_constraints()) is checked
        command.downgrade(migrate.alembic_config(database_url), "0013")
        assert [fk["referred_table"] for fk in key_constraints()] == ["api_keys"]
    finally:
        migrate.upgrade(database_url)
    assert bool(key_constraints()) is checked
    engine.dispose()


def test_migrating_twice_changes_nothing(database_url: str, repo_root: Path) -> None:
    """What the Kubernetes migration Job runs (`ferry db upgrade`) is safe to run again:
    a database already at head keeps its schema, its revision and its rows."""
    engine = make_engine(database_url)

    def schema() -> dict[str, Any]:
        inspector = inspect(engine)
        return {
            table: (
                sorted(c["name"] for c in inspector.get_columns(table)),
                sorted(str(i["name"]) for i in inspector.get_indexes(table)),
            )
            for table in inspector.get_table_names()
        }

    try:
        with Session(engine) as session:
            key_id = create_key(session, "kept").id
            session.commit()
        with engine.connect() as conn:
            revision = conn.scalar(text("SELECT version_num FROM alembic_version"))
        before = schema()
        env = {**os.environ, "FERRY_DATABASE_URL": database_url}
        for _ in range(2):
            assert "database at revision head" in run_ferry(["db", "upgrade"], repo_root, env)
        assert schema() == before
        with engine.connect() as conn:
            assert conn.scalar(text("SELECT version_num FROM alembic_version")) == revision
        with Session(engine) as session:
            assert session.scalar(select(ApiKey.name).where(ApiKey.id == key_id)) == "kept"
    finally:
        engine.dispose()
