"""The Python client of Ferry: ``Client`` and ``AsyncClient``, typed answers, retries, webhooks."""

from ferry_client._retry import Retries
from ferry_client.client import AsyncClient, Client
from ferry_client.errors import (
    APIConnectionError,
    APIError,
    BadRequest,
    Conflict,
    FerryError,
    NotFound,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from ferry_client.models import Backfill, Job, Model
from ferry_client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "APIConnectionError",
    "APIError",
    "AsyncClient",
    "Backfill",
    "BadRequest",
    "Client",
    "Conflict",
    "FerryError",
    "Job",
    "Model",
    "NotFound",
    "RateLimited",
    "Retries",
    "Unauthorized",
    "Unavailable",
    "WebhookVerificationError",
    "verify_webhook",
]
