"""Verifying Ferry's webhooks (Standard Webhooks signatures), with the standard library alone."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from typing import Any

from ferry_client.errors import FerryError

TOLERANCE_S = 300  # a delivery older or newer than this is refused (replay protection)
PREFIX = "whsec_"


class WebhookVerificationError(FerryError):
    """The delivery is not signed by this secret, or is too old or too new."""


def verify_webhook(
    headers: Mapping[str, str],
    body: bytes | str,
    secret: str,
    *,
    tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> dict[str, Any]:
    """The event of a delivery whose signature and timestamp check out; raises otherwise.

    ``headers``: the request's headers (any case); ``body``: its raw bytes, as
    received (not re-serialized); ``secret``: the key's ``whsec_...`` secret
    (``GET /v1/webhook-secret``). During a rotation the delivery carries a
    signature per secret: either secret verifies it.
    """
    lowered = {name.lower(): value for name, value in headers.items()}
    try:
        msg_id = lowered["webhook-id"]
        timestamp = lowered["webhook-timestamp"]
        signatures = lowered["webhook-signature"]
    except KeyError as missing:
        raise WebhookVerificationError(f"missing header {missing.args[0]}") from None
    try:
        sent_at = int(timestamp)
    except ValueError:
        raise WebhookVerificationError("webhook-timestamp is not a number") from None
    if abs((time.time() if now is None else now) - sent_at) > tolerance_s:
        raise WebhookVerificationError("webhook-timestamp is too old or too new")
    raw = body.encode() if isinstance(body, str) else body
    expected = base64.b64encode(
        hmac.new(_key(secret), f"{msg_id}.{sent_at}.".encode() + raw, hashlib.sha256).digest()
    ).decode()
    for signature in signatures.split():
        version, _, value = signature.partition(",")
        if version == "v1" and hmac.compare_digest(value, expected):
            event: dict[str, Any] = json.loads(raw)
            return event
    raise WebhookVerificationError("no signature matches the secret")


def _key(secret: str) -> bytes:
    try:
        return base64.b64decode(secret.removeprefix(PREFIX), validate=True)
    except ValueError:
        raise WebhookVerificationError("the secret is not a whsec_ secret") from None
