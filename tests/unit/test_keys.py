"""API keys: token format, hashing, verification, revocation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from core.db.keys import create_key, parse_token, verify_token
from core.db.schema import ApiKey, Base, utcnow

ID = "0123456789abcdef"


@pytest.fixture
def session() -> Iterator[Session]:
    # Schema from the models, only for this unit test of the hashing; the real
    # schema comes from the Alembic migrations.
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    with Session(engine, expire_on_commit=False) as db:
        yield db
    engine.dispose()


# --- parse_token -------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "expected"),
    [
        (f"fy_{ID}_secret", (ID, "secret")),
        # The secret is URL-safe base64 and may itself contain underscores.
        (f"fy_{ID}_a_b_c", (ID, "a_b_c")),
        (f"fy_{ID}__", (ID, "_")),
        (f"fy_{ID}_-x-", (ID, "-x-")),
    ],
)
def test_parse_token_accepts_well_formed(token: str, expected: tuple[str, str]) -> None:
    assert parse_token(token) == expected


@pytest.mark.parametrize(
    "token",
    [
        "",
        "fy",
        "fy_",
        f"fy_{ID}",
        f"fy_{ID}_",  # empty secret
        f"xx_{ID}_secret",  # wrong prefix
        f"FY_{ID}_secret",
        f"_{ID}_secret",
        f"fy_{ID[:-1]}_secret",  # id one short
        f"fy_{ID}0_secret",  # id one long
        "fy__secret",
        f"fy{ID}_secret",
        f"Bearer fy_{ID}_secret",
    ],
)
def test_parse_token_rejects_malformed(token: str) -> None:
    assert parse_token(token) is None


# --- create_key / verify_token ----------------------------------------------


def test_created_token_verifies(session: Session) -> None:
    new = create_key(session, "ci")
    assert new.name == "ci"
    assert new.token.startswith(f"fy_{new.id}_")
    assert parse_token(new.token) == (new.id, new.token.split("_", 2)[2])
    key = verify_token(session, new.token)
    assert key is not None
    assert key.id == new.id
    assert key.name == "ci"


def test_each_key_is_distinct(session: Session) -> None:
    a, b = create_key(session, "a"), create_key(session, "a")
    assert a.id != b.id
    assert a.token != b.token
    assert verify_token(session, a.token).id == a.id  # type: ignore[union-attr]
    assert verify_token(session, b.token).id == b.id  # type: ignore[union-attr]


def _change(token: str, position: int) -> str:
    old = token[position]
    new = "A" if old != "A" else "B"
    return token[:position] + new + token[position + 1 :]


@pytest.mark.parametrize(
    "where",
    ["prefix", "id-first", "id-last", "secret-first", "secret-middle", "secret-last"],
)
def test_token_with_one_changed_character_does_not_verify(session: Session, where: str) -> None:
    new = create_key(session, "ci")
    secret_start = len("fy_") + 16 + 1
    position = {
        "prefix": 0,
        "id-first": 3,
        "id-last": 3 + 15,
        "secret-first": secret_start,
        "secret-middle": (secret_start + len(new.token)) // 2,
        "secret-last": len(new.token) - 1,
    }[where]
    altered = _change(new.token, position)
    assert altered != new.token
    assert len(altered) == len(new.token)
    assert verify_token(session, altered) is None
    assert verify_token(session, new.token) is not None


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param(lambda t: t + "x", id="appended"),
        pytest.param(lambda t: t[:-1], id="truncated"),
        pytest.param(lambda t: t + " ", id="trailing-space"),
        pytest.param(lambda t: t.upper(), id="upper-case"),
    ],
)
def test_near_miss_tokens_do_not_verify(session: Session, variant: object) -> None:
    new = create_key(session, "ci")
    assert verify_token(session, variant(new.token)) is None  # type: ignore[operator]


def test_unknown_key_id_does_not_verify(session: Session) -> None:
    create_key(session, "ci")
    assert verify_token(session, f"fy_{ID}_whatever") is None


def test_another_keys_secret_does_not_verify(session: Session) -> None:
    a, b = create_key(session, "a"), create_key(session, "b")
    b_secret = b.token.split("_", 2)[2]
    assert verify_token(session, f"fy_{a.id}_{b_secret}") is None


def test_revoked_key_does_not_verify(session: Session) -> None:
    new = create_key(session, "ci")
    key = session.get(ApiKey, new.id)
    assert key is not None
    key.revoked_at = utcnow()
    session.commit()
    assert verify_token(session, new.token) is None


def test_stored_row_contains_no_part_of_the_secret(session: Session) -> None:
    new = create_key(session, "ci")
    secret = new.token.split("_", 2)[2]
    assert len(secret) >= 32
    row = session.execute(text("SELECT * FROM api_keys WHERE id = :id"), {"id": new.id}).one()
    stored = " ".join(str(value) for value in row)
    assert new.token not in stored
    windows = {secret[i : i + 8] for i in range(len(secret) - 7)}
    leaked = [w for w in windows if w in stored]
    assert leaked == []
