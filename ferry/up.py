"""``ferry up``: the whole stack on one machine, in the foreground.

Starts (or uses) Redis, migrates the database, then runs the API, one worker per
model, the Celery worker and beat as child processes. Ctrl-C or SIGTERM stops
them in order: the API first (no new work), then the workers (each finishes
its batch), then Celery, then the embedded Redis.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from core import migrate
from core.db import make_engine, make_sessionmaker
from core.keys import create_key, verify_token
from core.settings import Settings
from ferry.local_redis import start_redis

DRAIN_TIMEOUT_S = 30.0


@dataclass
class Child:
    name: str
    args: list[str]
    process: subprocess.Popen[bytes] | None = None


def _say(message: str) -> None:
    print(message, flush=True)


def dev_key(settings: Settings, data_dir: Path) -> str:
    """A ready-to-use key for this local stack, kept (0600) under the data dir."""
    path = data_dir / "api-key"
    engine = make_engine(settings.sqlalchemy_url)
    try:
        with make_sessionmaker(engine)() as session:
            if path.exists():
                token = path.read_text().strip()
                if verify_token(session, token) is not None:
                    return token
            token = create_key(session, "local").token
    finally:
        engine.dispose()
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token


def up(settings: Settings) -> int:
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["FERRY_DATA_DIR"] = str(data_dir)
    settings = settings.model_copy(update={"data_dir": data_dir})
    env["FERRY_DATABASE_URL"] = settings.sqlalchemy_url

    redis_process: subprocess.Popen[bytes] | None = None
    redis_url = settings.redis_url
    if redis_url is None:
        redis_process, redis_url = start_redis(data_dir)
        _say(f"started redis-server at {redis_url} (data in {data_dir / 'redis'})")
    env["FERRY_REDIS_URL"] = redis_url

    children: list[Child] = []
    stopping = False

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    try:
        migrate.upgrade(settings.sqlalchemy_url)
        token = dev_key(settings, data_dir)
        python = [sys.executable, "-m", "ferry"]
        children.append(Child("api", [*python, "api"]))
        for model in settings.model_names:
            children.append(Child(f"worker-{model}", [*python, "worker", "--model", model]))
        children.append(Child("celery-worker", [*python, "celery", "worker"]))
        children.append(Child("celery-beat", [*python, "celery", "beat"]))
        for child in children:
            # Own process group: Ctrl-C reaches only us, and we stop them in order.
            child.process = subprocess.Popen(child.args, env=env, start_new_session=True)
        base = f"http://{settings.api_host}:{settings.api_port}"
        if _wait_ready(base, children, lambda: stopping):
            _banner(settings, base, redis_url, token)
        while not stopping:
            dead = [c for c in children if c.process and c.process.poll() is not None]
            if dead:
                for child in dead:
                    _say(f"{child.name} exited with code {child.process.returncode}; stopping")  # type: ignore[union-attr]
                code = 1
                break
            time.sleep(0.2)
    finally:
        _say("stopping Ferry...")
        order = ["api", "worker-", "celery-beat", "celery-worker"]
        for prefix in order:
            _stop([c for c in children if c.name.startswith(prefix)])
        if redis_process is not None:
            _stop_process(redis_process)
        _say("stopped")
    return code


def _wait_ready(base: str, children: list[Child], stopping: object) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if callable(stopping) and stopping():
            return False
        if any(c.process and c.process.poll() is not None for c in children):
            return False
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    _say("the API did not become ready within 120 s")
    return False


def _banner(settings: Settings, base: str, redis_url: str, token: str) -> None:
    lines = [
        "",
        "Ferry is up.",
        f"  API       {base}   (docs: {base}/docs)",
        f"  Redis     {redis_url}",
        f"  Database  {settings.sqlalchemy_url}",
        f"  Models    {', '.join(settings.model_names)}",
        f"  API key   {token}",
        "",
        "Try:",
        f"  curl -s -X POST {base}/v1/jobs -H 'Authorization: Bearer {token}' \\",
        '       -H \'Content-Type: application/json\' -d \'{"model": "minilm", "input": "hello"}\'',
        f"  curl -s '{base}/v1/jobs/<id>?wait=10' -H 'Authorization: Bearer {token}'",
        "",
        "Ctrl-C stops everything.",
    ]
    _say("\n".join(lines))


def _stop(children: list[Child]) -> None:
    live = [c.process for c in children if c.process and c.process.poll() is None]
    for process in live:
        process.send_signal(signal.SIGTERM)
    for process in live:
        _wait_or_kill(process)


def _stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        _wait_or_kill(process)


def _wait_or_kill(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(timeout=DRAIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
