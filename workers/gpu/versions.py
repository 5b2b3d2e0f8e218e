"""Hot reload: a worker follows its model's active version without losing a job.

Every ``poll_s`` the worker reads the repository again (a new version folder,
a changed ``active_version``) and the database's activation. When the active
version is not the one it serves, it loads that version on a thread of its
own, beside the one serving, and warms it up; the batch loop then switches
new batches to it at the next step, lets the batch of the old version that
is on the device finish with its own runtime, and drops the old one. A
version that fails to load (bad weights, wrong shapes, a backend problem,
out of memory) leaves the old one serving; its state says why, and it is not
tried again until the repository or the activation changes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import InitVar, dataclass, field
from typing import Any

import redis
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from backends.base import OutOfMemory, Runtime
from core.db.versions import active_version, report
from core.models.repository import ModelConfig
from core.ops.collector import refreeze
from core.streams.target import REDIS_ERRORS

log = logging.getLogger(__name__)

# A worker that stops to load another version in a fresh process (not enough
# memory beside the one it serves): `ferry up` starts it again at once.
RESTART_EXIT_CODE = 76
# How long one worker of a model may hold its turn to restart.
RESTART_TURN_S = 600


@dataclass(frozen=True)
class Loaded:
    """A version loaded and warmed up, ready to take batches.

    ``prepared``: what the loop needs besides the runtime to run it (a
    :class:`~scheduler.Batcher` whose state is learned from the runtime's own
    calibration), or None to keep the loop's.
    """

    version: int
    runtime: Runtime
    prepared: Any = None


# Reads the model's config as the repository has it now (None: gone or broken).
ReadConfig = Callable[[], ModelConfig | None]
# Builds, loads and warms up ``version`` of the model.
LoadVersion = Callable[[ModelConfig, int], Loaded]


@dataclass(eq=False)
class VersionManager:
    """Decides when the worker loads another version; the loop switches to it.

    ``unloadable``: versions this worker must not try again as they are (one
    that did not load even alone, at the start of this process): each one's
    signature and why.
    """

    model: str
    serving: Loaded
    read_config: ReadConfig
    load: LoadVersion
    sessions: sessionmaker[Session]
    client: redis.Redis
    prefix: str
    consumer: str
    poll_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    unloadable: InitVar[dict[int, tuple[str, str]] | None] = None
    load_timeout_s: float = 900.0
    # The version the worker should serve, as of the last poll.
    wanted: int = field(init=False)
    # A version that did not fit beside the one serving: the worker
    # restarts to load it alone, when it is its turn.
    restart_for: int | None = field(init=False, default=None)

    def __post_init__(self, unloadable: dict[int, tuple[str, str]] | None) -> None:
        self._load_started = 0.0
        self._next_poll = 0.0
        self._loading: tuple[int, str, Future[Loaded]] | None = None
        # A version that failed, with what it failed on: not tried again until that changes.
        self._failed = {v: sig for v, (sig, _why) in (unloadable or {}).items()}
        self._failed_why = {v: why for v, (_sig, why) in (unloadable or {}).items()}
        self._lock = threading.Lock()
        self.wanted = self.serving.version
        self._dropped = False  # a version was dropped since collect_dropped last ran

    def start(self) -> None:
        self._report(self.serving.version, "ready")
        for version, why in self._failed_why.items():
            self._report(version, "failed", why)
        # Serving again after a restart: the next worker may take its turn.
        with contextlib.suppress(*REDIS_ERRORS):
            key = restart_key(self.prefix, self.model)
            if self.client.get(key) == self.consumer:
                self.client.delete(key)

    def poll(self, now: bool = False) -> Loaded | None:
        """A version loaded and ready to switch to, when there is one; never blocks on a load.

        Reads the repository and the activation every ``poll_s`` (``now``: at
        once), also while a load runs: a load that is no longer wanted when it
        ends is dropped, and another version wanted meanwhile is loaded next.
        """
        with self._lock:
            loaded = self._loaded() if self._loading is not None else None
            moment = self.clock()
            if not now and moment < self._next_poll:
                return loaded
            self._next_poll = moment + self.poll_s
            config = self.read_config()
            if config is None:
                return loaded
            try:
                with self.sessions() as session:
                    self.wanted = active_version(session, config)
            except SQLAlchemyError:
                return loaded  # the database is away: keep serving what is loaded
            if loaded is not None and loaded.version != self.wanted:
                loaded = None  # activated, then rolled back before it was ready
            if self.restart_for is not None and self.restart_for != self.wanted:
                self.restart_for = None  # another version is wanted now
            wanted = self.wanted
            if (
                loaded is not None
                or wanted == self.serving.version
                or self._loading is not None
                or self.restart_for is not None
            ):
                return loaded
            stamp = signature(config, wanted)
            if self._failed.get(wanted) == stamp:
                return None
            self._failed.pop(wanted, None)
            log.info(
                "loading another version",
                extra={"model": self.model, "version": wanted, "serving": self.serving.version},
            )
            self._report(wanted, "loading")
            self._load_started = moment
            self._loading = (wanted, stamp, _in_background(self.load, config, wanted))
            return None

    def _loaded(self) -> Loaded | None:
        assert self._loading is not None
        version, stamp, future = self._loading
        if not future.done():
            if self.clock() - self._load_started > self.load_timeout_s:
                # A load that hangs (a user's __init__ that never returns) must not
                # block later activations: it is given up; its thread is a daemon.
                self._loading = None
                self._give_up(
                    version,
                    stamp,
                    f"did not load within {self.load_timeout_s:g} s",
                    "version load timed out; the one serving goes on",
                )
            return None
        self._loading = None
        try:
            loaded = future.result()
        except Exception as exc:
            reason = (str(exc) or type(exc).__name__).splitlines()[0][:500]
            if out_of_memory(exc):
                # It may fit alone: the worker restarts to load it, one worker at a time.
                self.restart_for = version
                self._report(
                    version,
                    "loading",
                    f"no room beside version {self.serving.version}; the worker restarts to "
                    f"load it ({reason})",
                )
                return None
            self._give_up(version, stamp, reason, "version failed to load; the one serving goes on")
            return None
        return loaded

    def _give_up(self, version: int, stamp: str, reason: str, message: str) -> None:
        """``version`` failed: it is not tried again until what it failed on (``stamp``)
        changes."""
        self._failed[version] = stamp
        self._report(version, "failed", reason)
        log.error(
            message,
            extra={
                "model": self.model,
                "version": version,
                "reason": reason,
                "serving": self.serving.version,
            },
        )

    def take_restart_turn(self) -> bool:
        """Whether this worker may restart now: one worker of the model at a time."""
        key = restart_key(self.prefix, self.model)
        try:
            taken = self.client.set(key, self.consumer, nx=True, ex=RESTART_TURN_S)
            return bool(taken) or self.client.get(key) == self.consumer
        except REDIS_ERRORS:
            return False

    def failed(self, version: int) -> bool:
        """Whether this worker could not load ``version`` (and will not try it again as it is)."""
        return version in self._failed

    def switched(self, new: Loaded) -> Loaded:
        """The loop switched new batches to ``new``; returns the one it replaced (draining)."""
        old, self.serving = self.serving, new
        self._report(new.version, "ready")
        self._report(old.version, "draining")
        log.info(
            "switched version",
            extra={"model": self.model, "version": new.version, "previous": old.version},
        )
        return old

    def rolled_back(self, previous: Loaded, reason: str) -> Loaded:
        """The loop serves ``previous`` again: the version that replaced it failed its trial
        (:mod:`workers.gpu.probation`). It is failed, and not loaded again as it is."""
        with self._lock:
            bad, self.serving = self.serving, previous
            config = self.read_config()
            self._failed[bad.version] = signature(config, bad.version) if config else ""
        self._report(bad.version, "failed", reason)
        self._report(previous.version, "ready")
        log.error(
            "version rolled back: its batches failed whole",
            extra={
                "model": self.model,
                "version": bad.version,
                "serving": previous.version,
                "reason": reason,
            },
        )
        return bad

    def unloaded(self, old: Loaded) -> None:
        """The old version's last batch is done: it is dropped."""
        self._report(old.version, None)
        self._dropped = True

    def collect_dropped(self) -> None:
        """Once no frame holds a dropped version any more (the loop calls this at the
        start of a step): what it left in reference cycles is freed (:func:`refreeze`)."""
        if self._dropped:
            self._dropped = False
            refreeze()

    def stop(self) -> None:
        self._report(self.serving.version, None)

    def _report(self, version: int, state: str | None, reason: str | None = None) -> None:
        # Advisory (what GET /v1/models shows): the worker goes on without it.
        with contextlib.suppress(*REDIS_ERRORS):
            report(self.client, self.prefix, self.model, self.consumer, version, state, reason)


def _in_background(load: LoadVersion, config: ModelConfig, version: int) -> Future[Loaded]:
    """Run a load on a daemon thread: a load that hangs never keeps the process from exiting."""
    future: Future[Loaded] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(load(config, version))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name=f"load-{config.name}-{version}", daemon=True).start()
    return future


def out_of_memory(exc: BaseException) -> bool:
    """Whether a load failed for want of memory (torch's CUDA error, or the host's)."""
    return isinstance(exc, OutOfMemory | MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def restart_key(prefix: str, model: str) -> str:
    """Which worker of the model is restarting to load another version (one at a time)."""
    return f"{prefix}:{{{model}}}:restarting"


def signature(config: ModelConfig, version: int) -> str:
    """What a version's load depends on: its model.toml and its folder, as of now."""
    stamps: list[int] = []
    with contextlib.suppress(OSError, KeyError):
        stamps.append(config.config_file.stat().st_mtime_ns)
        folder = config.versions[version].files
        # Not what loading writes itself (Python's bytecode cache): that would
        # make every failed python model look changed, and be tried again forever.
        stamps += sorted(
            entry.stat().st_mtime_ns
            for entry in os.scandir(folder)
            if entry.name != "__pycache__" and not entry.name.startswith(".")
        )
    return f"{version}:{stamps}"
