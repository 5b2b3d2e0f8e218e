"""How the commands that talk to the HTTP API find it, and how they report its errors.

The API is ``--api`` (or ``FERRY_API_URL``, default
``http://FERRY_API_HOST:FERRY_API_PORT``) and the key is ``--key`` (or
``FERRY_API_KEY``, else the key ``ferry up`` keeps in the data directory).
Both may be given to the command group (``ferry jobs --api URL get ID``) or
to the command itself; the command's own wins.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

import typer

from ferry.console import fail

if TYPE_CHECKING:
    from ferry_client import Client

ApiOption = Annotated[
    str | None,
    typer.Option(
        "--api", help="API base URL (default: FERRY_API_URL or local)", show_default=False
    ),
]
KeyOption = Annotated[
    str | None,
    typer.Option("--key", help="API key (default: FERRY_API_KEY or ferry up's key)"),
]
JsonOption = Annotated[
    bool,
    typer.Option("--json", help="JSON for scripts: one document, or one object per line"),
]


@dataclass(frozen=True)
class Target:
    """``--api``, ``--key`` (and ``--json``) as the command group got them (``ctx.obj``)."""

    api: str | None = None
    key: str | None = None
    as_json: bool = False


def remember(ctx: typer.Context, api: str | None, key: str | None, as_json: bool = False) -> None:
    ctx.obj = Target(api, key, as_json)


def given(ctx: typer.Context) -> Target:
    """What the command group was given (subcommands see their group's ``ctx.obj``)."""
    return ctx.obj if isinstance(ctx.obj, Target) else Target()


def default_key() -> str:
    if os.environ.get("FERRY_API_KEY"):
        return os.environ["FERRY_API_KEY"]
    from core.config.settings import get_settings

    path = get_settings().data_dir / "api-key"
    if path.exists():
        return path.read_text().strip()
    raise fail("no API key: pass --key, set FERRY_API_KEY, or run `ferry up` here first")


def default_api() -> str:
    if os.environ.get("FERRY_API_URL"):
        return os.environ["FERRY_API_URL"]
    from core.config.settings import get_settings

    settings = get_settings()
    host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::") else settings.api_host
    return f"http://{host}:{settings.api_port}"


def connect(
    ctx: typer.Context, api: str | None, key: str | None, *, timeout_s: float = 30.0
) -> Client:
    """The SDK's client for the API and key the command was given (or the defaults)."""
    from ferry_client import Client

    group = given(ctx)
    return Client(
        api or group.api or default_api(), key or group.key or default_key(), timeout_s=timeout_s
    )


@contextlib.contextmanager
def reported(by_status: bool = False) -> Iterator[None]:
    """The SDK's errors as ``error: <type>: <message>`` on stderr, exit status 1.

    ``by_status``: ``error: <status>: <message>``, the form ``ferry backfill``
    has always printed (scripts match it).
    """
    from ferry_client import APIConnectionError, APIError

    try:
        yield
    except APIError as exc:
        raise fail(f"{exc.status if by_status else exc.type}: {exc.message}") from None
    except APIConnectionError as exc:
        raise fail(f"connection: {exc}") from None
