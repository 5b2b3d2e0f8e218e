"""``ferry keys``: create, list, revoke and rotate API keys, on the database directly.

A token is printed once, when it is made (create, rotate); the database keeps
only a salted hash. ``list`` never prints a secret.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from sqlalchemy.orm import Session

from core.keys import SCOPES, create_key, list_keys, revoke_key, rotate_key
from core.settings import get_settings


@contextlib.contextmanager
def database_session() -> Iterator[Session]:
    """A session on the configured database, migrated to the newest revision first."""
    from core import migrate
    from core.db import make_engine, make_sessionmaker

    settings = get_settings()
    if settings.database_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(settings.sqlalchemy_url)
    engine = make_engine(settings.sqlalchemy_url)
    try:
        with make_sessionmaker(engine)() as session:
            yield session
    finally:
        engine.dispose()


def _create(args: argparse.Namespace) -> int:
    with database_session() as session:
        key = create_key(session, args.name, args.scope)
    # The token stays on the last line, for scripts (`... | tail -n 1`).
    print(f"webhook signing secret (also at GET /v1/webhook-secret): {key.webhook_secret}")
    print(f"created {args.scope} API key {key.id} ({key.name}); it is shown once:")
    print(key.token)
    return 0


def _list(_args: argparse.Namespace) -> int:
    with database_session() as session:
        rows = list_keys(session)
        print(f"{'id':16}  {'scope':6}  {'created':20}  {'revoked':20}  name")
        for key in rows:
            revoked = key.revoked_at.strftime("%Y-%m-%d %H:%M:%S") if key.revoked_at else "-"
            created = key.created_at.strftime("%Y-%m-%d %H:%M:%S")
            print(f"{key.id:16}  {key.scope:6}  {created:20}  {revoked:20}  {key.name}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    with database_session() as session:
        key = revoke_key(session, args.id)
    if key is None:
        print(f"no API key {args.id!r}")
        return 1
    print(f"revoked API key {key.id} ({key.name}): its token is refused from now on")
    return 0


def _rotate(args: argparse.Namespace) -> int:
    with database_session() as session:
        key = rotate_key(session, args.id)
    if key is None:
        print(f"no live API key {args.id!r}")
        return 1
    print(f"new token for API key {key.id} ({key.name}); the old one is refused from now on.")
    # Whoever held the old token could read the signing secret too.
    print("its webhook signing secret is unchanged: if the old token may have leaked, rotate")
    print("it as well (POST /v1/webhook-secret/rotate with the new token).")
    print("It is shown once:")
    print(key.token)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    create.add_argument("--name", required=True)
    create.add_argument(
        "--scope", choices=SCOPES, default="client",
        help="client (default): its own jobs; admin: also the operator endpoints",
    )  # fmt: skip
    create.set_defaults(fn=_create)
    keys_sub.add_parser("list", help="every key, without secrets").set_defaults(fn=_list)
    revoke = keys_sub.add_parser("revoke", help="refuse a key's token from now on")
    revoke.add_argument("id")
    revoke.set_defaults(fn=_revoke)
    rotate = keys_sub.add_parser("rotate", help="a new token for a key; the old one stops")
    rotate.add_argument("id")
    rotate.set_defaults(fn=_rotate)
