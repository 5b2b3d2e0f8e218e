"""Alembic environment: the URL comes from Ferry's settings (or the caller)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from core.config.settings import get_settings
from core.db.schema import Base, make_engine

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().sqlalchemy_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    else:
        engine = make_engine(_url())
        try:
            with engine.connect() as conn:
                _run(conn)
        finally:
            engine.dispose()
