"""The repository, checked with its backends, and the API's catalog built from it.

``check`` is what ``ferry models check`` prints and what ``ferry up``, the
API and the workers refuse to start on: every problem of the repository's
files (core.models.repository) and of each model's backend (its files, its
parameters, its input kind), each naming the file and the field.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Collection
from dataclasses import replace

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from backends import UnknownBackend, get_backend
from backends.base import Runtime, RuntimeOptions, resolve_device
from core.config.settings import PER_MODEL, Settings, knob_problem
from core.models.catalog import ModelSpec, input_spec
from core.models.reader import load_repository
from core.models.repository import ModelConfig, Problem, Repository
from scheduler.vocabulary import BATCH_SIZE_CEILING, BATCH_SIZE_FLOOR

log = logging.getLogger(__name__)


def repository_for(settings: Settings, only: str | None = None) -> Repository:
    """The repository FERRY_MODEL_REPOSITORY names, FERRY_MODEL_PARAMETERS applied.

    ``only``: read that model's folder alone (a worker's poll needs no other).
    """
    return load_repository(
        settings.model_repository_path,
        overrides=settings.model_parameters,
        known_settings=PER_MODEL,
        only=only,
    )


def check(repository: Repository, served: Collection[str] | None = None) -> list[Problem]:
    """Every problem of ``repository``; those of models not ``served`` are only warnings."""
    problems = list(repository.problems)
    for model in repository.models.values():
        found = model_problems(model)
        if served is not None and model.name not in served:
            found = [replace(p, warning=True) for p in found]
        problems += found
    if served is not None:
        for name in served:
            # A folder whose model.toml has errors is reported already.
            if name not in repository.models and not (repository.root / name).is_dir():
                known = ", ".join(sorted(repository.models)) or "none"
                problems.append(
                    Problem(
                        str(repository.root),
                        "",
                        f"has no model {name!r} (FERRY_MODELS lists it; the repository has: "
                        f"{known})",
                    )
                )
    return problems


def model_problems(model: ModelConfig, versions: Collection[int] | None = None) -> list[Problem]:
    """The backend's problems with one model: input kind, settings, each version (or those)."""
    problems = []
    for name, value in model.settings.items():
        reason = knob_problem(name, value)
        if reason:
            table = "memory" if name.startswith(("memory", "gpu")) else "batching"
            field = "precision" if name == "precision" else f"{table}.{name}"
            problems.append(Problem(model.where(), field, reason))
    try:
        backend = get_backend(model.backend)
    except UnknownBackend as exc:
        return [*problems, Problem(model.where(), "backend", str(exc))]
    if model.input.kind not in backend.input_kinds:
        kinds = ", ".join(sorted(backend.input_kinds))
        problems.append(
            Problem(
                model.where(),
                "input.kind",
                f"{model.backend} takes {kinds} inputs, not {model.input.kind}",
            )
        )
        return problems
    for version in model.versions.values():
        if versions is None or version.number in versions:
            tokenizer = model.tokenizer_path(version.number)
            if tokenizer is not None and not tokenizer.is_file():
                problems.append(
                    Problem(
                        model.where(version.folder),
                        "",
                        f"{model.input.tokenizer} is missing (input.tokenizer; the API counts "
                        "tokens with it)",
                    )
                )
            problems += backend.check(model, version)
    return problems


def build_catalog(settings: Settings, repository: Repository | None = None) -> dict[str, ModelSpec]:
    """A spec for each model of the repository that can be served.

    The API takes jobs for all of them, with or without a worker running
    (they wait in the queue for one). A model with a problem is left out;
    one that FERRY_MODELS lists makes this raise
    core.models.repository.RepositoryError, as any problem of the repository itself does.
    """
    from core.models.repository import RepositoryError

    repository = repository or repository_for(settings)
    served = settings.model_names
    problems = check(repository, served)
    errors = [p for p in problems if not p.warning]
    if errors:
        raise RepositoryError(errors)
    warnings = [p for p in problems if p.warning]
    catalog = {}
    for name in sorted(repository.models):
        model = repository[name]
        if any(model.concerns(p) for p in warnings):
            continue  # not served, and with a problem: it takes no jobs
        backend = get_backend(model.backend)
        refine = getattr(backend, "input_config", None)
        as_checked = replace(model, input=refine(model)) if refine else model
        catalog[name] = ModelSpec(
            name=name,
            description=model.description,
            backend=model.backend,
            active_version=model.active_version,
            versions=tuple(sorted(model.versions)),
            # Unset, the worker derives it: at most the ceiling.
            max_batch_size=settings.for_model(name, model.settings).tuning.batch_max_size
            or BATCH_SIZE_CEILING,
            input=input_spec(as_checked),
            embeddings=model.embeddings,
        )
    return catalog


class LiveVersions:
    """Each served model's versions and active version as they are now, and whether an
    operator unloaded it.

    Re-read (the repository's version folders, the database's activations)
    at most every ``poll_s``, so a new version or an activation is seen by
    the API as soon as by the workers: the first question (and the first
    after :meth:`forget`) waits for the read; later ones answer from the last
    read and, once it is a poll old, start the next in a thread of its own
    (reading the repository's files and the database on the event loop
    stalled every request for it once a second). A request about to be
    refused on an old read asks again with ``fresh`` (read now).

    The unloaded models are read on their own, by one small query at most
    every ``poll_s`` (every second when it is 0: workers take no part in an
    unload), in a thread of its own: every
    submission asks for them, on the event loop, which must not wait for the
    database (an outage would stall it for the connection's timeout).
    """

    def __init__(
        self, settings: Settings, sessions: sessionmaker[Session], poll_s: float = 1.0
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._repository: Repository | None = None
        self._activated: dict[str, int] = {}
        self._reading = False  # a read in its thread, not finished
        self._started = 0  # reads begun; the latest begun that ended wins
        self._applied = 0
        self._as_of = -float("inf")  # when the read that is answered from began
        self._unloads_lock = threading.Lock()
        self._unloads_read_at = -float("inf")
        self._unloads_reading = False  # a read in its thread, not finished
        self._unloads_started = 0  # reads begun; the latest begun that ended wins
        self._unloads_applied = 0
        self._unloaded: frozenset[str] | None = None  # None: never read

    def _refresh(self) -> None:
        """Called holding ``_lock``: read now if never read (or forgotten), else start a
        read in a thread when the last is a poll old."""
        now = time.monotonic()
        if self._repository is None or self._read_at == -float("inf"):
            self._read_at = now
            self._started += 1
            self._apply(self._started, now, *self._read())
            return
        # poll_s 0: workers never follow a change, so neither does the API.
        if self.poll_s == 0 or now - self._read_at < self.poll_s or self._reading:
            return
        # A failed read too: the last answer stands, and it is tried again a poll later.
        self._read_at = now
        self._reading = True
        self._started += 1
        threading.Thread(
            target=self._read_in_background,
            args=(self._started, now),
            name="versions",
            daemon=True,
        ).start()

    def _read(self) -> tuple[Repository, dict[str, int]]:
        from core.db.schema import ModelActivation

        repository = repository_for(self.settings)
        with self.sessions() as session:
            rows = session.execute(select(ModelActivation.model, ModelActivation.version)).all()
        return repository, {row.model: row.version for row in rows}

    def _read_in_background(self, number: int, began: float) -> None:
        try:
            found: tuple[Repository, dict[str, int]] | None = self._read()
        except (OSError, SQLAlchemyError, ValueError) as exc:
            log.warning(
                "model versions could not be read", extra={"error_type": type(exc).__name__}
            )
            found = None
        with self._lock:
            self._reading = False
            if found is not None:
                self._apply(number, began, *found)

    def _apply(
        self, number: int, began: float, repository: Repository, activated: dict[str, int]
    ) -> None:
        # A read begun before another that ended first must not undo what it saw.
        if number > self._applied:
            self._applied = number
            self._as_of = began
            self._repository = repository
            self._activated = activated

    def of(self, spec: ModelSpec, fresh: bool = False) -> tuple[tuple[int, ...], int]:
        """``(versions, active)`` of the model; the catalog's own if it cannot be read now.

        ``fresh``: read now unless the last read is under a poll old (before refusing a
        request on what an earlier read said)."""
        with self._lock:
            try:
                if fresh and self.poll_s and time.monotonic() - self._as_of >= self.poll_s:
                    self._read_at = -float("inf")
                self._refresh()
            except (OSError, SQLAlchemyError, ValueError):
                return spec.versions, spec.active_version
            model = self._repository.models.get(spec.name) if self._repository else None
        if model is None:
            return spec.versions, spec.active_version
        chosen = self._activated.get(spec.name)
        active = chosen if chosen is not None and chosen in model.versions else model.active_version
        return tuple(sorted(model.versions)), active

    def model(self, name: str) -> ModelConfig | None:
        with self._lock:
            self._refresh()
            return self._repository.models.get(name) if self._repository else None

    def models(self) -> dict[str, ModelConfig]:
        """Every model of the repository, served or not."""
        with self._lock:
            self._refresh()
            return dict(self._repository.models) if self._repository else {}

    def unloaded(self, name: str) -> bool:
        """Whether an operator unloaded the model, as last read (the first question waits
        for the first read; later ones start the next read when the last is a poll old)."""
        unloaded = self._unloaded
        if unloaded is None:
            self._read_unloads()
            unloaded = self._unloaded or frozenset()
        elif time.monotonic() - self._unloads_read_at >= (self.poll_s or 1.0):
            with self._unloads_lock:
                start = not self._unloads_reading
                self._unloads_reading = True
            if start:
                threading.Thread(
                    target=self._read_unloads, args=(True,), name="unloads", daemon=True
                ).start()
        return name in unloaded

    def _read_unloads(self, background: bool = False) -> None:
        from core.db.versions import unloaded_models

        with self._unloads_lock:
            self._unloads_started += 1
            mine = self._unloads_started
            # A failed read too: the last answer stands, and it is tried again a poll later.
            self._unloads_read_at = time.monotonic()
        found: frozenset[str] | None = None
        try:
            with self.sessions() as session:
                found = frozenset(unloaded_models(session))
        except (OSError, SQLAlchemyError):
            pass
        finally:
            if background:
                with self._unloads_lock:
                    self._unloads_reading = False
        with self._unloads_lock:
            if found is None:
                # Never read: none is taken for unloaded until the database answers (it
                # takes no job meanwhile either), rather than every question waiting on it.
                if self._unloaded is None:
                    self._unloaded = frozenset()
            elif mine > self._unloads_applied:
                # A read begun before another that ended first must not undo what it saw.
                self._unloads_applied = mine
                self._unloaded = found

    def forget(self) -> None:
        """This process has just changed an activation or an unload: the next question reads
        the activations again, and the unloads are read now."""
        with self._lock:
            self._read_at = -float("inf")
        self._read_unloads()


def cpu_threads(setting: int, cores: int | None = None) -> int:
    """FERRY_CPU_THREADS, resolved: 0 means half the host's cores, at least one."""
    if setting:
        return setting
    return max(1, (cores or os.cpu_count() or 2) // 2)


def load_runtime(
    model: ModelConfig,
    settings: Settings,
    version: int | None = None,
    device: str | None = None,
) -> Runtime:
    """Build and load ``model``'s runtime for ``version`` (None: the active one).

    ``settings`` must carry the model's own (``Settings.for_model``). Raises
    core.models.repository.RepositoryError when the model's backend finds a problem,
    before anything is loaded.
    """
    from core.models.repository import RepositoryError

    number = model.active_version if version is None else version
    errors = model_problems(model, [number])
    if errors:
        raise RepositoryError(errors)
    backend = get_backend(model.backend)
    options = RuntimeOptions(
        device="sim" if not backend.uses_device else resolve_device(device or settings.device),
        precision=settings.precision,
        budget_bytes=settings.memory_budget_bytes,
        # The largest batch the scheduler may send, warmed up at start-up. A derived
        # size is warmed up at the floor: most models keep it, and one that learns to
        # send larger batches grows its pools under traffic.
        warmup_batch=settings.tuning.batch_max_size or BATCH_SIZE_FLOOR,
        memory_fraction=settings.gpu_memory_fraction,
        reclaim_bytes=settings.gpu_reclaim_bytes,
        cpu_threads=cpu_threads(settings.cpu_threads),
    )
    runtime = backend.runtime(model, model.version(number), options)
    runtime.load()
    return runtime
