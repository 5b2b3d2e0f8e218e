"""What the model routes do: which model and version a request names, activations,
and the database's health, callable without HTTP."""

from __future__ import annotations

import logging
import re

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from api.errors import ApiError
from backends.catalog import LiveVersions, model_problems
from core.db.schema import ModelActivation
from core.db.versions import ActivationError, activate, active_version
from core.models.catalog import ModelSpec
from core.models.repository import ModelConfig

log = logging.getLogger(__name__)


class UnknownModel(ApiError):
    """No model of that name: a 422 on Ferry's own routes; the OpenAI and inference protocol
    routes answer it with their 404."""


def resolve_model(
    catalog: dict[str, ModelSpec],
    model: str,
    version: int | None = None,
    live: LiveVersions | None = None,
    *,
    taking_jobs: bool = True,
) -> tuple[ModelSpec, int | None]:
    """The model a request names (``name`` or ``name@N``) and the version it asks for.

    ``live`` gives the versions and the active one as they are now (default:
    as they were at start-up). A version that exists but is not the active
    one is refused: workers serve the active version. With ``live``, a model
    an operator unloaded is refused too, unless the request makes no job
    (``taking_jobs`` false: its metadata, say).
    """
    name, at, suffix = model.partition("@")
    if at:
        if not re.fullmatch(r"[1-9][0-9]{0,8}", suffix):
            raise ApiError(
                422, "invalid_request", f"model: {model!r} must be 'name' or 'name@N' (N a version)"
            )
        if version is not None and version != int(suffix):
            raise ApiError(
                422, "invalid_request", f"version: {version} differs from the model's @{suffix}"
            )
        version = int(suffix)
    spec = catalog.get(name)
    if spec is None:
        known = ", ".join(sorted(catalog))
        message = f"model: unknown model {name!r} (known: {known})"
        raise UnknownModel(422, "invalid_request", message)
    if taking_jobs and live is not None and live.unloaded(name):
        raise ApiError(
            422,
            "invalid_request",
            f"model: {name!r} is unloaded: it takes no new jobs until an operator loads it "
            f"(POST /v2/repository/models/{name}/load)",
        )
    if version is None:
        return spec, None
    numbers, active = live.of(spec) if live is not None else (spec.versions, spec.active_version)
    if live is not None and (version not in numbers or version != active):
        # About to refuse on the last read, which may be up to a poll old: read again.
        numbers, active = live.of(spec, fresh=True)
    if version not in numbers:
        versions = ", ".join(map(str, numbers))
        raise ApiError(
            422,
            "invalid_request",
            f"version: {name} has no version {version} (versions: {versions})",
        )
    if version != active:
        raise ApiError(
            422,
            "invalid_request",
            f"version: {name}@{version} takes no jobs; its active version is {active}",
        )
    return spec, version


def served_model(
    catalog: dict[str, ModelSpec], live: LiveVersions, name: str
) -> tuple[ModelSpec, ModelConfig]:
    """The model ``name`` as the API serves it and as the repository has it now; 404 for a
    model it does not serve."""
    spec = catalog.get(name)
    model = live.model(name) if spec is not None else None
    if spec is None or model is None:
        raise ApiError(404, "not_found", f"model: no model {name!r} is served")
    return spec, model


def activate_version(session: Session, model: ModelConfig, version: int) -> int:
    """Make ``version`` the one new jobs run on (a rollback too); the version active before.

    A version the repository lacks, or whose files the backend finds a
    problem with, is a 422 and changes nothing; one that fails to load in a
    worker leaves the old one serving (GET /v1/models says why).
    """
    problems = model_problems(model, [version]) if version in model.versions else []
    if problems:
        raise ApiError(422, "invalid_request", f"version: {'; '.join(map(str, problems))}")
    previous = active_version(session, model)
    try:
        activate(session, model, version)
    except ActivationError as exc:
        raise ApiError(422, "invalid_request", f"version: {exc}") from None
    log.info(
        "version activated", extra={"model": model.name, "version": version, "previous": previous}
    )
    return previous


def activations(session: Session, model: str | None = None) -> dict[str, tuple[int, float]]:
    """Each activated model's version and when it was activated (Unix seconds); ``model``:
    that one's only."""
    query = select(ModelActivation.model, ModelActivation.version, ModelActivation.updated_at)
    if model is not None:
        query = query.where(ModelActivation.model == model)
    rows = session.execute(query).all()
    return {row.model: (row.version, row.updated_at.timestamp()) for row in rows}


def ping(session: Session) -> None:
    """A round trip to the database; raises what the database raises."""
    session.execute(text("SELECT 1"))


def is_generation(catalog: dict[str, ModelSpec], model: str) -> bool:
    """Whether ``model`` is a generation model (its jobs stream tokens and can be stopped)."""
    spec = catalog.get(model)
    return spec is not None and getattr(spec.input, "kind", None) == "generation"
