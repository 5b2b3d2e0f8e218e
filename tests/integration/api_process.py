"""``ferry api`` in a process of its own, for the tests of what the command itself does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from core.db.keys import create_key
from core.db.schema import make_engine, make_sessionmaker
from harness import webclient


def key_token(database_url: str, name: str) -> str:
    """A new key's token, made on an engine of its own (the API is another process)."""
    engine = make_engine(database_url)
    with make_sessionmaker(engine)() as session:
        token = create_key(session, name).token
    engine.dispose()
    return token


def start_api(
    redis_url: str, database_url: str, key_prefix: str, data_dir: Path, port: int, **env: str
) -> subprocess.Popen[bytes]:
    """``ferry api --port port`` on the test's services, with ``env``'s FERRY_ settings too
    (none of the caller's own)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    environ.update(
        FERRY_REDIS_URL=redis_url,
        FERRY_DATABASE_URL=database_url,
        FERRY_KEY_PREFIX=key_prefix,
        FERRY_DATA_DIR=str(data_dir),
        FERRY_LOG_LEVEL="WARNING",
        **env,
    )
    return subprocess.Popen(
        [sys.executable, "-m", "ferry", "api", "--port", str(port)], env=environ, cwd=data_dir
    )


def ready(base: str) -> bool:
    try:
        return webclient.get(f"{base}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
