"""API keys: ``fy_<id>_<secret>``. Only a salted hash of the secret is stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy.orm import Session

from core.db import ApiKey

PREFIX = "fy"


@dataclass(frozen=True)
class NewKey:
    id: str
    name: str
    token: str  # shown once, never stored


def _hash(salt: str, secret: str) -> str:
    return hmac.new(bytes.fromhex(salt), secret.encode(), hashlib.sha256).hexdigest()


def create_key(session: Session, name: str) -> NewKey:
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    salt = secrets.token_hex(16)
    session.add(ApiKey(id=key_id, name=name, salt=salt, secret_hash=_hash(salt, secret)))
    session.commit()
    return NewKey(id=key_id, name=name, token=f"{PREFIX}_{key_id}_{secret}")


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
