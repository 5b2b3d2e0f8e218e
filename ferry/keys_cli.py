"""``ferry keys``: create, list, revoke and rotate API keys, on the database directly.

A token is printed once, when it is made (create, rotate); the database keeps
only a salted hash. ``list`` never prints a secret.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from ferry.console import (
    IdArgument,
    Row,
    choice_argument,
    choice_option,
    one_of,
    show_table,
)
from scheduler.vocabulary import Lane

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@contextlib.contextmanager
def database_session() -> Iterator[Session]:
    """A session on the configured database, migrated to the newest revision first."""
    from core.config.settings import get_settings
    from core.db import migrate
    from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker

    settings = get_settings()
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.sqlalchemy_url)
    engine = engine_for(settings.section(DatabaseSettings))
    try:
        with make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


app = typer.Typer(help="API keys", no_args_is_help=True)


def _scopes() -> list[str]:
    # core.db.keys (and SQLAlchemy's ORM) only when a key is made: `ferry jobs` starts faster.
    from core.db.keys import SCOPES

    return list(SCOPES)


def _scope(value: str) -> str | None:
    return one_of(*_scopes())(value)


LANES = [str(lane) for lane in Lane]


@app.command("create", help="create a key and print it (once)")
def create(
    name: Annotated[str, typer.Option("--name", show_default=False)],
    scope: Annotated[
        str,
        typer.Option(
            "--scope",
            metavar="SCOPE",
            callback=_scope,
            autocompletion=_scopes,
            help="client (default): its own jobs; admin: also the operator endpoints",
            show_default=False,
        ),
    ] = "client",
    embeddings_lane: Annotated[
        str | None,
        choice_option(
            "--embeddings-lane",
            "LANE",
            LANES,
            "the lane of its POST /v1/embeddings inputs when a request names none "
            "(X-Ferry-Priority); default normal",
        ),
    ] = None,
) -> int:
    from core.db.keys import create_key

    with database_session() as session:
        key = create_key(session, name, scope, embeddings_lane)
    # The token stays on the last line, for scripts (`... | tail -n 1`).
    print(f"webhook signing secret (also at GET /v1/webhook-secret): {key.webhook_secret}")
    print(f"created {scope} API key {key.id} ({key.name}); it is shown once:")
    print(key.token)
    return 0


def _plain_keys(columns: Sequence[str], rows: Sequence[Row]) -> list[str]:
    """The columns this command has always printed (scripts split them on spaces)."""
    widths = (16, 6, 20, 20)
    return [
        "  ".join(f"{value:{width}}" for value, width in zip(row, widths, strict=False))
        + f"  {row[-1]}"
        for row in [columns, *rows]
    ]


@app.command("list", help="every key, without secrets")
def list_() -> int:
    from core.db.keys import list_keys

    with database_session() as session:
        rows = [
            (
                key.id,
                key.scope,
                key.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                key.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if key.revoked_at else "-",
                key.name,
            )
            for key in list_keys(session)
        ]
    show_table(("id", "scope", "created", "revoked", "name"), rows, plain=_plain_keys)
    return 0


Changed = TypeVar("Changed")


def _changed(
    change: Callable[..., Changed | None], id: str, *args: Any, missing: str = "no API key"
) -> Changed | None:
    """``change(session, id, *args)`` in a session of its own; None, said, where it finds
    no key."""
    with database_session() as session:
        key = change(session, id, *args)
    if key is None:
        print(f"{missing} {id!r}")
    return key


@app.command("revoke", help="refuse a key's token from now on")
def revoke(id: IdArgument) -> int:
    from core.db.keys import revoke_key

    key = _changed(revoke_key, id)
    if key is None:
        return 1
    print(f"revoked API key {key.id} ({key.name}): its token is refused from now on")
    return 0


@app.command("embeddings-lane", help="the lane of a key's embeddings when a request names none")
def embeddings_lane(
    id: IdArgument,
    lane: Annotated[
        str,
        choice_argument("LANE", [*LANES, "default"], "a lane, or default (normal)"),
    ],
) -> int:
    from core.db.keys import set_embeddings_lane

    key = _changed(set_embeddings_lane, id, None if lane == "default" else lane)
    if key is None:
        return 1
    print(
        f"API key {key.id} ({key.name}): embeddings in the {key.embeddings_lane or 'normal'} "
        "lane unless a request names one (the API sees it within its key cache's lifetime)"
    )
    return 0


@app.command("weight", help="a key's share of a generation engine against other keys'")
def weight(
    id: IdArgument,
    value: Annotated[
        float,
        typer.Argument(
            metavar="WEIGHT",
            help="above 0, at most 1000; 1 is every key's by default (equal shares)",
            show_default=False,
        ),
    ],
) -> int:
    from core.db.keys import set_weight

    try:
        key = _changed(set_weight, id, value)
    except ValueError as exc:
        print(exc)
        return 2
    if key is None:
        return 1
    print(
        f"API key {key.id} ({key.name}): weight {key.weight:g} (generation workers follow it "
        "within their key cache's lifetime)"
    )
    return 0


@app.command("rotate", help="a new token for a key; the old one stops")
def rotate(id: IdArgument) -> int:
    from core.db.keys import rotate_key

    key = _changed(rotate_key, id, missing="no live API key")
    if key is None:
        return 1
    print(f"new token for API key {key.id} ({key.name}); the old one is refused from now on.")
    # Whoever held the old token could read the signing secret too.
    print("its webhook signing secret is unchanged: if the old token may have leaked, rotate")
    print("it as well (POST /v1/webhook-secret/rotate with the new token).")
    print("It is shown once:")
    print(key.token)
    return 0
