"""/v1/backfills: a dataset in (NDJSON), progress, results out, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from api.backfills import service as services
from api.backfills.schemas import BackfillList, BackfillResource
from api.deps import CatalogDep, CheckCallbackDep, KeyDep, RedisDep, SessionDep, SettingsDep
from api.errors import ApiError
from api.models.service import resolve_model
from api.schemas import error_responses
from api.state import app_state
from core.db.backfills import result_lines
from core.models.catalog import text_problem

router = APIRouter(
    prefix="/v1/backfills", tags=["backfills"], responses=error_responses(401, 422, 503)
)

NDJSON_BODY = {
    "requestBody": {
        "required": True,
        "description": 'One {"custom_id": "...", "input": ...} per line.',
        "content": {"application/x-ndjson": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.post(
    "",
    status_code=202,
    response_model=BackfillResource,
    responses=error_responses(413),
    openapi_extra=NDJSON_BODY,
)
async def create_backfill(
    request: Request,
    response: Response,
    key: KeyDep,
    catalog: CatalogDep,
    settings: SettingsDep,
    client: RedisDep,
    check_callback: CheckCallbackDep,
    model: Annotated[str, Query(min_length=1, max_length=64)],
    callback_url: Annotated[str | None, Query(min_length=1, max_length=2048)] = None,
) -> BackfillResource:
    """Upload a file of inputs; each line becomes a job in the model's bulk lane.

    The body is read as it arrives. A line that cannot be taken refuses the
    whole file, with its line number, and nothing of it is kept.
    """
    spec, version = resolve_model(catalog, model, None, app_state(request).versions)
    if version is not None:
        raise ApiError(
            422,
            "invalid_request",
            f"model: a backfill runs on the model's active version; name it without @{version}",
        )
    if callback_url is not None:
        problem = text_problem(callback_url)
        if problem:
            raise ApiError(422, "invalid_request", f"callback_url: must not contain {problem}")
        await run_in_threadpool(check_callback, callback_url)
    sessions = app_state(request).sessions
    backfill_id = await services.upload(
        request.stream(), sessions, key, spec, callback_url, settings
    )
    response.headers["Location"] = f"/v1/backfills/{backfill_id}"

    def load() -> BackfillResource:
        with sessions() as session:
            backfill = services.get_backfill(session, key, backfill_id)
            return services.to_resource(
                backfill, services.learned_rate(client, settings.key_prefix)
            )

    return await run_in_threadpool(load)


@router.get("", response_model=BackfillList)
def list_backfills(
    key: KeyDep,
    session: SessionDep,
    client: RedisDep,
    settings: SettingsDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> BackfillList:
    rate = services.learned_rate(client, settings.key_prefix)
    return BackfillList(
        data=[services.to_resource(b, rate) for b in services.list_backfills(session, key, limit)]
    )


@router.get("/{backfill_id}", response_model=BackfillResource, responses=error_responses(404))
def read_backfill(
    backfill_id: str, key: KeyDep, session: SessionDep, client: RedisDep, settings: SettingsDep
) -> BackfillResource:
    backfill = services.get_backfill(session, key, backfill_id)
    return services.to_resource(backfill, services.learned_rate(client, settings.key_prefix))


@router.get(
    "/{backfill_id}/results",
    responses={
        200: {
            "description": 'NDJSON, in input order: {"custom_id", "status", "output" | "error"} '
            "for every finished line (while it runs: those finished so far).",
            "content": {"application/x-ndjson": {}},
        },
        **error_responses(404),
    },
)
def read_results(backfill_id: str, request: Request, key: KeyDep, session: SessionDep) -> Response:
    backfill = services.get_backfill(session, key, backfill_id)
    return StreamingResponse(
        result_lines(app_state(request).sessions, backfill.id),
        media_type="application/x-ndjson",
    )


@router.post(
    "/{backfill_id}/cancel", response_model=BackfillResource, responses=error_responses(404, 409)
)
def cancel_backfill(backfill_id: str, key: KeyDep, session: SessionDep) -> BackfillResource:
    """Stop feeding; running batches finish, the rest is cancelled."""
    return services.to_resource(services.cancel(session, key, backfill_id))
