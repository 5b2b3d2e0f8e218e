"""/v1/webhook-secret: the calling key's webhook signing secret."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import KeyDep, SessionDep, SettingsDep
from api.jobs import service as services
from api.jobs.schemas import WebhookSecret
from api.schemas import error_responses

router = APIRouter(
    prefix="/v1/webhook-secret", tags=["webhooks"], responses=error_responses(401, 503)
)


@router.get("", response_model=WebhookSecret)
def read_secret(key: KeyDep, session: SessionDep, settings: SettingsDep) -> WebhookSecret:
    """The secret that signs this key's webhooks (verify with any Standard Webhooks library)."""
    return services.webhook_secret(session, key, False, settings.webhook_secret_grace_s)


@router.post("/rotate", response_model=WebhookSecret)
def rotate_secret(key: KeyDep, session: SessionDep, settings: SettingsDep) -> WebhookSecret:
    """A new secret; the previous one also signs for webhook_secret_grace_s (both signatures
    are sent), so receivers can switch without missing a webhook."""
    return services.webhook_secret(session, key, True, settings.webhook_secret_grace_s)
