"""API keys: ``fy_<id>_<secret>``. Only a salted hash of the secret is stored.

Each key also has a webhook signing secret (``whsec_<base64>``, Standard
Webhooks), which its owner can read and rotate.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.db.schema import ApiKey, utcnow
from scheduler.vocabulary import Lane

PREFIX = "fy"
SCOPES = ("client", "admin")


@dataclass(frozen=True)
class NewKey:
    id: str
    name: str
    token: str  # shown once, never stored
    webhook_secret: str


def _hash(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


def create_key(
    session: Session, name: str, scope: str = "client", embeddings_lane: str | None = None
) -> NewKey:
    """A new key. ``embeddings_lane``: the lane of its OpenAI-compatible embeddings when a
    request names none (default: normal)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}")
    _check_lane(embeddings_lane)
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    webhook_secret = new_webhook_secret()
    session.add(
        ApiKey(
            id=key_id,
            name=name,
            salt=salt,
            secret_hash=_hash(salt, secret),
            webhook_secret=webhook_secret,
            scope=scope,
            embeddings_lane=embeddings_lane,
        )
    )
    session.commit()
    return NewKey(
        id=key_id, name=name, token=f"{PREFIX}_{key_id}_{secret}", webhook_secret=webhook_secret
    )


def _check_lane(lane: str | None) -> None:
    if lane is not None and lane not in {str(value) for value in Lane}:
        raise ValueError(f"lane must be one of {', '.join(str(value) for value in Lane)}")


def set_embeddings_lane(session: Session, key_id: str, lane: str | None) -> ApiKey | None:
    """The lane of the key's embeddings when a request names none (None: normal).
    None if there is no such key."""
    _check_lane(lane)
    return _set(session, key_id, embeddings_lane=lane)


def _set(session: Session, key_id: str, **columns: Any) -> ApiKey | None:
    """Set ``columns`` on the key under a row lock; None if there is no such key."""
    row = session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        return None
    for name, value in columns.items():
        setattr(row, name, value)
    session.commit()
    return row


# The heaviest weight a key may have, against the default 1.
MAX_WEIGHT = 1000.0


def set_weight(session: Session, key_id: str, weight: float) -> ApiKey | None:
    """The key's share of a generation engine against other keys' (1: equal). None if there
    is no such key; ValueError for a weight not in (0, MAX_WEIGHT]."""
    if not (0 < weight <= MAX_WEIGHT):  # NaN fails this too
        raise ValueError(f"weight must be above 0 and at most {MAX_WEIGHT:g}, got {weight}")
    return _set(session, key_id, weight=weight)


def list_keys(session: Session) -> list[ApiKey]:
    """Every key, oldest first (their hashes and secrets are the caller's to leave out)."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_key(session: Session, key_id: str) -> ApiKey | None:
    """Revoke now: the next request with its token is a 401. None if there is no such key."""
    row = session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        return None
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    session.commit()
    return row


def rotate_key(session: Session, key_id: str) -> NewKey | None:
    """A new token for the same key (its jobs stay its own); the old token stops at once."""
    row = session.get(ApiKey, key_id, with_for_update=True)
    if row is None or row.revoked_at is not None:
        return None
    secret = secrets.token_urlsafe(32)
    row.salt = secrets.token_hex(16)
    row.secret_hash = _hash(row.salt, secret)
    session.commit()
    return NewKey(
        id=row.id,
        name=row.name,
        token=f"{PREFIX}_{row.id}_{secret}",
        webhook_secret=row.webhook_secret or "",
    )


def new_webhook_secret() -> str:
    # 32 random bytes: the Standard Webhooks specification asks for 24 to 64.
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def rotate_webhook_secret(session: Session, key: ApiKey, grace_s: float) -> ApiKey:
    """A new secret signs from now on; the old one also signs for ``grace_s`` more."""
    row = session.get(ApiKey, key.id, with_for_update=True)
    assert row is not None
    row.previous_webhook_secret = row.webhook_secret if grace_s > 0 else None
    row.previous_webhook_secret_until = (
        utcnow() + dt.timedelta(seconds=grace_s) if row.previous_webhook_secret else None
    )
    row.webhook_secret = new_webhook_secret()
    session.commit()
    return row


def signing_secrets(key: ApiKey, now: dt.datetime) -> list[str]:
    """The secrets a webhook is signed with now: the current one, then one still in grace."""
    found = [key.webhook_secret] if key.webhook_secret else []
    until = key.previous_webhook_secret_until
    if key.previous_webhook_secret and until is not None and until > now:
        found.append(key.previous_webhook_secret)
    return found


def parse_token(token: str) -> tuple[str, str] | None:
    parts = token.split("_", 2)
    if len(parts) != 3 or parts[0] != PREFIX or len(parts[1]) != 16 or not parts[2]:
        return None
    return parts[1], parts[2]


def verify_token(session: Session, token: str) -> ApiKey | None:
    """The live key this token belongs to, or None. Constant-time comparison."""
    parsed = parse_token(token)
    if parsed is None:
        return None
    key_id, secret = parsed
    key = session.get(ApiKey, key_id)
    if key is None or key.revoked_at is not None:
        return None
    if not hmac.compare_digest(key.secret_hash, _hash(key.salt, secret)):
        return None
    return key
