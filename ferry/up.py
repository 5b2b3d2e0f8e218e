"""``ferry up``: the whole stack on one machine, in the foreground.

Builds the files of a served model that is built from a recipe (ferry.built_models),
starts (or uses) Redis, migrates the database, then runs the API, one worker per
model, the Celery worker and beat (unless FERRY_UP_CELERY=0), and Flower as child
processes. Ctrl-C or SIGTERM stops them in order: the API first (no new work), then the
workers (each finishes its batch), then Celery and Flower, then the embedded Redis. A
child that dies on its own is restarted with backoff; one that dies five times in a minute
stops the stack.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from backends.catalog import check, repository_for
from core.config.settings import Settings
from core.db import migrate
from core.db.keys import create_key, verify_token
from core.db.schema import DatabaseSettings, engine_for, make_sessionmaker
from core.models.repository import Repository
from core.streams.target import RedisSettings, RedisTarget
from ferry.built_models import build_missing
from ferry.children import ChildProcess, fork_ferry, stop_with_parent
from ferry.local_redis import start_redis
from workers.gpu.versions import RESTART_EXIT_CODE

MIN_DRAIN_S = 30.0
READY_TIMEOUT_S = 120.0


CRASH_WINDOW_S = 60.0
CRASH_LIMIT = 5
# Restarts to load another model version a worker may ask for in CRASH_WINDOW_S
# before they count as crashes.
RELOAD_LIMIT = 3
# The children's own modules, imported by `ferry up` before it forks them (FERRY_UP_FORK):
# each child then starts with them, and with what `ferry up` imported for itself
# (settings, the database and Redis clients). Never the model runtime: torch's threads
# and CUDA must start in the worker that uses them.
CHILD_MODULES = ("ferry.serve", "api.app", "workers.gpu.main", "workers.tasks.app")
FERRY = [sys.executable, "-m", "ferry"]


@dataclass
class Child:
    """A supervised process: restarted with backoff when it dies on its own."""

    name: str
    args: list[str]
    process: ChildProcess | None = None
    crashes: deque[float] = field(default_factory=deque)
    # Restarts it asked for (exit code 76) in the last CRASH_WINDOW_S.
    reloads: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    # Settings for this child only (a secret the others must not see).
    own_env: dict[str, str] = field(default_factory=dict)
    # A crash loop of a child that is not critical (Flower) stops only that child.
    critical: bool = True
    given_up: bool = False
    # Started as a fork of `ferry up` (a `ferry` command only), not a new interpreter.
    fork: bool = False

    def start(self, env: dict[str, str]) -> None:
        # Own process group: Ctrl-C reaches only `ferry up`, which stops
        # the children in order; stopped even when `ferry up` is killed.
        if self.fork and self.args[: len(FERRY)] == FERRY:
            self.process = fork_ferry(self.args[len(FERRY) :], env | self.own_env)
        else:
            self.process = subprocess.Popen(
                self.args,
                env=env | self.own_env,
                start_new_session=True,
                preexec_fn=stop_with_parent,
            )
        self.restart_at = None

    def check(self, now: float, env: dict[str, str]) -> bool:
        """Restart if due; returns False when it crashes too often to go on."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start(env)
            return True
        if self.given_up or self.process is None or self.process.poll() is None:
            return True
        if self.process.returncode == RESTART_EXIT_CODE:
            # A worker that stopped to load another model version alone: not a crash,
            # unless it keeps doing so (then it backs off as a crashing child does).
            self.reloads.append(now)
            while self.reloads and now - self.reloads[0] > CRASH_WINDOW_S:
                self.reloads.popleft()
            if len(self.reloads) <= RELOAD_LIMIT:
                _say(f"{self.name} restarts to load another version of its model")
                self.start(env)
                return True
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > CRASH_WINDOW_S:
            self.crashes.popleft()
        code = self.process.returncode
        if len(self.crashes) >= CRASH_LIMIT:
            if not self.critical:
                _say(
                    f"{self.name} exited with code {code} {CRASH_LIMIT} times in a minute; "
                    "it stays stopped, the rest of Ferry runs on"
                )
                self.given_up = True
                return True
            _say(f"{self.name} exited with code {code} {CRASH_LIMIT} times in a minute; stopping")
            return False
        delay = min(2.0 ** (len(self.crashes) - 1), 30.0)
        _say(f"{self.name} exited with code {code}; restarting in {delay:g} s")
        self.restart_at = now + delay
        return True


def _say(message: str) -> None:
    print(message, flush=True)


def dev_key(settings: Settings, data_dir: Path) -> str:
    """A ready-to-use key for this local stack, kept (0600) under the data dir."""
    path = data_dir / "api-key"
    engine = engine_for(settings.section(DatabaseSettings))
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


def flower_password(settings: Settings, data_dir: Path) -> str:
    """FERRY_FLOWER_PASSWORD, or one made for this data dir and kept there (0600)."""
    if settings.flower_password is not None:
        return settings.flower_password.get_secret_value()
    path = data_dir / "flower-password"
    if path.is_file() and not path.is_symlink() and path.read_text().strip():
        path.chmod(0o600)
        return path.read_text().strip()
    password = secrets.token_urlsafe(18)
    # Written private from its first byte, then put in place whole.
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(password + "\n")
    os.replace(temporary, path)
    return password


def up(settings: Settings) -> int:
    # A served model built from a recipe (tiny-llama) gets its files first: it is checked next.
    if not build_missing(settings.model_repository_path, settings.model_names, _say):
        _say("a served model's files cannot be built; not starting")
        return 2
    # A repository Ferry cannot serve stops it here, before anything starts.
    repository = repository_for(settings)
    problems = check(repository, settings.model_names)
    for problem in problems:
        _say(f"{'warning' if problem.warning else 'error'}: {problem}")
    if any(not p.warning for p in problems):
        where = settings.model_repository_path
        _say(f"the model repository ({where}) cannot be served; not starting")
        return 2
    data_dir = settings.data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["FERRY_DATA_DIR"] = str(data_dir)
    # Every process reads the same repository, wherever it starts.
    env["FERRY_MODEL_REPOSITORY"] = str(settings.model_repository_path.resolve())
    settings = settings.model_copy(update={"data_dir": data_dir})
    env["FERRY_DATABASE_URL"] = settings.sqlalchemy_url

    redis_process: subprocess.Popen[bytes] | None = None
    redis_url = settings.redis_url
    if redis_url is None and not settings.redis_sentinels:
        redis_process, redis_url = start_redis(data_dir, stop_with_parent=True)
        _say(f"started redis-server at {redis_url} (data in {data_dir / 'redis'})")
    if redis_url is not None:
        env["FERRY_REDIS_URL"] = redis_url
    redis_text = redis_url or RedisTarget.of(settings.section(RedisSettings)).describe()

    children: list[Child] = []
    stopping = False

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    # One client for every readiness probe: each new one loads a CA bundle (25 ms of CPU).
    probe = httpx.Client(timeout=2)
    try:
        migrate.upgrade(settings.sqlalchemy_url)
        token = dev_key(settings, data_dir)
        children.append(Child("api", [*FERRY, "api"]))
        ports = metrics_ports(settings)
        for name, model, gpu in worker_plan(settings):
            device = ["--device", "cuda:0"] if gpu is not None else []
            children.append(
                Child(
                    name,
                    [
                        *FERRY,
                        "worker",
                        "--model",
                        model,
                        *device,
                        *instance_of(name),
                        *_port_arg(ports, name),
                    ],
                    # Each worker sees its own GPU (or MIG slice) only.
                    own_env={"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {},
                )
            )
        if settings.up_celery:
            children.append(
                Child(
                    "celery-worker",
                    [*FERRY, "celery", "worker", *_port_arg(ports, "celery-worker")],
                )
            )
            children.append(Child("celery-beat", [*FERRY, "celery", "beat"]))
        password = None
        if settings.flower_port:
            password = flower_password(settings, data_dir)
            children.append(
                Child(
                    "flower",
                    [*FERRY, "flower"],
                    own_env={"FERRY_FLOWER_PASSWORD": password},
                    critical=False,
                )
            )
        if settings.up_fork:
            for module in CHILD_MODULES:
                importlib.import_module(module)
        for child in children:
            child.fork = settings.up_fork
            child.start(env)
        base = f"http://{settings.api_host}:{settings.api_port}"
        ready_deadline = time.monotonic() + READY_TIMEOUT_S
        announced = False
        while not stopping:
            now = time.monotonic()
            if not all(child.check(now, env) for child in children):
                code = 1
                break
            if not announced:
                if _ready(probe, base):
                    _banner(settings, base, redis_text, token, password)
                    announced = True
                elif now > ready_deadline:
                    _say(f"the API did not become ready within {READY_TIMEOUT_S:g} s; stopping")
                    code = 1
                    break
            time.sleep(0.25)
    finally:
        probe.close()
        _say("stopping Ferry...")
        # The API first (it goes not-ready, then finishes what is in flight),
        # then the workers (each finishes and records its batch), then Celery.
        # Celery's processes (beat, its worker, Flower) stop together: none waits on another.
        drain = {
            ("api",): settings.api_shutdown_delay_s + settings.max_wait_s + 10.0,
            ("worker-",): settings.worker_drain_s + 5.0,
            ("celery-beat", "celery-worker", "flower"): MIN_DRAIN_S,
        }
        for prefixes, drain_s in drain.items():
            if not _stop([c for c in children if c.name.startswith(prefixes)], drain_s):
                code = code or 1
        if redis_process is not None:
            _stop_process(redis_process)
        _say("stopped")
    return code


def _ready(probe: httpx.Client, base: str) -> bool:
    try:
        return probe.get(f"{base}/readyz").status_code == 200
    except httpx.HTTPError:
        return False


def metrics_ports(
    settings: Settings, visible: Callable[[], list[str]] | None = None
) -> dict[str, int]:
    """The /metrics port of each process `ferry up` starts besides the API (which has its own)."""
    if not settings.metrics_port_base:
        return {}
    names = [name for name, _model, _gpu in worker_plan(settings, visible)]
    names += ["celery-worker"] if settings.up_celery else []
    return {name: settings.metrics_port_base + i for i, name in enumerate(names)}


def worker_plan(
    settings: Settings,
    visible: Callable[[], list[str]] | None = None,
    repository: Repository | None = None,
) -> list[tuple[str, str, str | None]]:
    """``(child name, model, CUDA_VISIBLE_DEVICES or None)`` of every worker to start.

    A model's [instances] decide: ``device = "auto"`` or ``"gpu"``, ``count``
    workers on each GPU (on the CPU without GPUs); ``"cpu"`` and ``"none"``
    (needs no device: sim), ``count`` workers in all.
    """
    repository = repository or repository_for(settings)
    gpus = _gpus(settings.gpus, visible or visible_gpus)
    plan: list[tuple[str, str, str | None]] = []
    for model in settings.model_names:
        config = repository.models.get(model)
        device, count = (config.device, config.count) if config else ("auto", 1)
        copies = [f"#{i + 1}" if count > 1 else "" for i in range(count)]
        if device in ("auto", "gpu") and gpus:
            plan += [(f"worker-{model}-gpu{gpu}{c}", model, gpu) for gpu in gpus for c in copies]
        else:
            plan += [(f"worker-{model}{c}", model, None) for c in copies]
    return plan


def instance_of(child: str) -> list[str]:
    """``--instance N`` for the N-th of several workers of a model on one device (``...#N``)."""
    _, mark, number = child.rpartition("#")
    return ["--instance", number] if mark else []


def _gpus(setting: str, visible: Callable[[], list[str]]) -> list[str]:
    if setting == "none":
        return []
    if setting == "auto":
        return visible()
    return setting.split(",")


def visible_gpus() -> list[str]:
    """What CUDA_VISIBLE_DEVICES lists, or else every GPU NVML finds (none without a driver)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(index) for index in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library or no driver: a CPU machine
        return []


def _port_arg(ports: dict[str, int], name: str) -> list[str]:
    return ["--metrics-port", str(ports[name])] if name in ports else []


def _banner(
    settings: Settings, base: str, redis: str, token: str, flower_password: str | None
) -> None:
    served = settings.model_names
    # minilm's job when it is served; another model's input is described by GET /v1/models.
    example = (
        json.dumps({"model": "minilm", "input": "hello"})
        if "minilm" in served
        else json.dumps({"model": served[0], "input": "..."})
        if served
        else "{}"
    )
    flower = (
        [
            f"  Flower    http://{settings.flower_host}:{settings.flower_port}"
            f"   (user {settings.flower_user}, password {flower_password})"
        ]
        if flower_password is not None
        else []
    )
    lines = [
        "",
        "Ferry is up.",
        f"  API       {base}   (docs: {base}/docs)",
        *(
            [f"  gRPC      {settings.api_host}:{settings.grpc_port}   (the inference protocol)"]
            if settings.grpc_port
            else []
        ),
        f"  Redis     {redis}",
        f"  Database  {settings.sqlalchemy_url}",
        f"  Models    {', '.join(served)}",
        f"  API key   {token}",
        f"  Webhooks  signed with the secret at GET {base}/v1/webhook-secret",
        *(
            []
            if settings.up_celery
            else ["  Celery    not started (FERRY_UP_CELERY=0): no webhook, backfill or reconciler"]
        ),
        *flower,
        "  Metrics   "
        + ", ".join(
            [f"api {base}/metrics"]
            + [f"{name} :{port}" for name, port in metrics_ports(settings).items()]
        ),
        "",
        "Try:",
        f"  curl -s -X POST {base}/v1/jobs -H 'Authorization: Bearer {token}' \\",
        f"       -H 'Content-Type: application/json' -d '{example}'",
        f"  curl -s '{base}/v1/jobs/<id>?wait=10' -H 'Authorization: Bearer {token}'",
        "",
        "Ctrl-C stops everything.",
    ]
    _say("\n".join(lines))


def _stop(children: list[Child], drain_s: float = MIN_DRAIN_S) -> bool:
    """SIGTERM, then wait (SIGKILL after the drain timeout); False if any ended badly."""
    live = [c for c in children if c.process and c.process.poll() is None]
    for child in live:
        child.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    clean = True
    for child in live:
        code = _wait_or_kill(child.process, drain_s)  # type: ignore[arg-type]
        # uvicorn re-raises the SIGTERM it handled, after a clean shutdown.
        if code not in (0, -signal.SIGTERM):
            _say(f"{child.name} stopped with code {code}")
            clean = False
    return clean


def _stop_process(process: ChildProcess) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        _wait_or_kill(process)


def _wait_or_kill(process: ChildProcess, drain_s: float = MIN_DRAIN_S) -> int:
    try:
        return process.wait(timeout=drain_s)
    except subprocess.TimeoutExpired:
        # The whole process group: a child with processes of its own (the API's
        # several processes) leaves none behind.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()
        return process.wait()
