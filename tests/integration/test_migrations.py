"""The schema exists only through Alembic, on SQLite and PostgreSQL alike."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect

from core import migrate
from core.db import Base, make_engine


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
