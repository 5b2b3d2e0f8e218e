"""/v1/models (OpenAI's list and model objects, with Ferry's own fields) and health."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)

from api.deps import CatalogDep, KeyDep, RedisDep, SettingsDep
from api.errors import ApiError
from api.models import service as model_service
from api.models.schemas import GenerationInfo, ModelInfo, ModelList, VersionInfo
from api.openai.routes import OPENAI_ERRORS
from api.openai_errors import openai_error
from api.schemas import error_responses
from api.state import ApiSettings, AppState, app_state
from core.db.versions import version_states
from core.models.catalog import ModelSpec
from core.models.generation import GenerationSpec
from core.models.generation_estimates import GenerationEstimate
from core.ops.metrics import queue_metrics, token_matches
from core.streams.queues import lane_depths, live_workers, numeric_stats, stats_text
from core.streams.target import REDIS_ERRORS

log = logging.getLogger(__name__)

router = APIRouter()


@router.get(
    "/v1/models", response_model=ModelList, tags=["models"], responses=error_responses(401, 503)
)
def list_models(
    _key: KeyDep, request: Request, client: RedisDep, catalog: CatalogDep, settings: SettingsDep
) -> ModelList:
    """Every model the API takes jobs for: OpenAI's list shape, Ferry's fields beside."""
    activations = _activations(request)
    return ModelList(
        data=[
            _model_info(spec, request, client, settings, activations) for spec in catalog.values()
        ]
    )


@router.get(
    "/v1/models/{model_id}",
    response_model=ModelInfo,
    tags=["models"],
    responses={
        **error_responses(401, 503),
        404: OPENAI_ERRORS[404],  # in OpenAI's error shape, as its clients read it
    },
)
def retrieve_model(
    model_id: str,
    _key: KeyDep,
    request: Request,
    client: RedisDep,
    catalog: CatalogDep,
    settings: SettingsDep,
) -> ModelInfo | JSONResponse:
    """One model, as GET /v1/models lists it."""
    spec = catalog.get(model_id)
    if spec is None:
        # OpenAI's clients raise NotFoundError on this shape, as on the embeddings route.
        known = ", ".join(sorted(catalog))
        message = f"model: unknown model {model_id!r} (known: {known})"
        status, body = openai_error(404, {"type": "model_not_found", "message": message})
        return JSONResponse(body, status_code=status)
    return _model_info(spec, request, client, settings, _activations(request, model_id))


def _activations(request: Request, model: str | None = None) -> dict[str, tuple[int, float]]:
    """Each activated model's version and when it was activated (Unix seconds)."""
    with app_state(request).sessions() as session:
        return model_service.activations(session, model)


def _model_info(
    spec: ModelSpec,
    request: Request,
    client: redis.Redis,
    settings: ApiSettings,
    activations: dict[str, tuple[int, float]],
) -> ModelInfo:
    raw = stats_text(client, settings.key_prefix, spec.name)
    stats = numeric_stats(raw)
    known, active = app_state(request).versions.of(spec)
    states = version_states(client, settings.key_prefix, spec.name)
    activated = activations.get(spec.name)
    if activated is not None and activated[0] == active:
        created = activated[1]
    else:
        created = _modified(settings.model_repository_path / spec.name / "model.toml")
    generation = None
    if isinstance(spec.input, GenerationSpec):
        learned = GenerationEstimate.from_hash(raw)  # None until a worker has published
        generation = GenerationInfo(
            context_tokens=spec.input.context_tokens,
            default_max_tokens=spec.input.default_max_tokens,
            chat=spec.input.chat is not None,
            execution=None if learned is None else learned.execution,
            why=(learned.why or None) if learned is not None else None,
            prefix_caching=None if learned is None else learned.prefix_caching,
            step_fixed_ms=None if learned is None else _ms(learned.step_a_s),
            step_per_token_ms=None if learned is None else _ms(learned.step_b_s, 6),
        )
    return ModelInfo(
        id=spec.name,
        created=int(created),
        name=spec.name,
        kind=spec.input.kind,
        generation=generation,
        backend=spec.backend,
        version=active,
        versions=[
            VersionInfo(
                version=number,
                active=number == active,
                state=states[number].state if number in states else "available",
                reason=states[number].reason if number in states else None,
                workers=states[number].workers if number in states else 0,
            )
            for number in known
        ],
        description=spec.description,
        input_schema=spec.input_schema,
        max_batch_size=spec.max_batch_size,
        queue_depth=lane_depths(client, settings.key_prefix, spec.name),
        workers=live_workers(client, settings.key_prefix, spec.name),
        avg_batch_ms=stats.get("avg_batch_ms"),
        avg_batch_size=stats.get("avg_batch_size"),
        latency_fixed_ms=_ms(stats.get("latency_a_s")),
        latency_per_work_ms=_ms(stats.get("latency_b_s"), 6),
        window_ms=_ms(stats.get("window_s")),
        batch_efficiency=stats.get("efficiency"),
    )


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _ms(seconds: float | None, digits: int = 3) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, digits)


@router.get(
    "/metrics",
    tags=["health"],
    response_class=PlainTextResponse,
    responses=error_responses(401),
)
def metrics(
    request: Request, client: RedisDep, catalog: CatalogDep, settings: SettingsDep
) -> PlainTextResponse:
    """Prometheus metrics of this API process, and the queues' state read from Redis now.

    With FERRY_METRICS_TOKEN set, only for "Authorization: Bearer <that token>".
    """
    if not token_matches(settings.metrics_bearer, request.headers.get("authorization")):
        raise ApiError(
            401, "unauthorized", "metrics token required", {"WWW-Authenticate": "Bearer"}
        )
    body = generate_latest(_registry())
    try:
        body += queue_metrics(client, settings.key_prefix, catalog, app_state(request).scalers)
    except REDIS_ERRORS as exc:
        log.warning("queue metrics unavailable", extra={"error_type": type(exc).__name__})
    return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)


def _registry() -> CollectorRegistry:
    """This process's metrics; with several API processes, all of theirs (summed)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        return REGISTRY
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    return registry


@router.get("/healthz", tags=["health"])
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"])
def readyz(request: Request, client: RedisDep) -> JSONResponse:
    ready, checks = readiness(app_state(request), client)
    headers = None if ready else {"Retry-After": "5"}
    return JSONResponse(
        {"status": "ready" if ready else "not_ready", "checks": checks},
        status_code=200 if ready else 503,
        headers=headers,
    )


def readiness(state: AppState, client: redis.Redis) -> tuple[bool, dict[str, str]]:
    """Whether the API is ready for traffic, and each check's finding (blocking: a thread)."""
    checks: dict[str, str] = {}
    if state.draining:
        checks["api"] = "shutting down"
    try:
        client.ping()
        checks["redis"] = "ok"
    except REDIS_ERRORS as exc:
        checks["redis"] = f"unreachable ({type(exc).__name__})"
    try:
        with state.sessions() as session:
            model_service.ping(session)
        checks["database"] = "ok"
    except Exception as exc:
        checks["database"] = f"unreachable ({type(exc).__name__})"
    # Jobs are accepted while Redis is down (the database holds them until the
    # reconciler enqueues them), so only the database and a stop make the API
    # not ready; Redis's state is reported.
    return checks["database"] == "ok" and "api" not in checks, checks
