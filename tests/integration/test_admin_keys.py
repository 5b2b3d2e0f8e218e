"""Keys and scopes: admin endpoints need the admin scope; revoking and rotating take effect
at the next request; `ferry keys` never prints a secret it did not just make."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from core.config.settings import Settings
from core.db.keys import create_key, rotate_key, set_weight
from core.db.schema import ApiKey, make_engine, make_sessionmaker

ADMIN_PATHS = [("GET", "/v1/admin/queues"), ("GET", "/v1/admin/keys"),
               ("POST", "/v1/admin/keys/0123456789abcdef/revoke")]  # fmt: skip


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_operator_endpoints_need_the_admin_scope(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        plain = create_key(session, "team-a").token
    for method, path in ADMIN_PATHS:
        refused = client.request(method, path, headers=_bearer(plain))
        assert refused.status_code == 403, (path, refused.text)
        assert refused.json()["error"]["type"] == "forbidden"
        assert "admin scope" in refused.json()["error"]["message"]
        assert client.request(method, path).status_code == 401


def test_an_admin_sees_every_tenants_queue_and_key(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        admin = create_key(session, "ops", "admin")
        team_a = create_key(session, "team-a")
        team_b = create_key(session, "team-b")
    for token, count in ((team_a.token, 3), (team_b.token, 1)):
        for _ in range(count):
            response = client.post(
                "/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=_bearer(token)
            )
            assert response.status_code == 202
    overview = client.get("/v1/admin/queues", headers=_bearer(admin.token))
    assert overview.status_code == 200, overview.text
    sim = next(m for m in overview.json()["data"] if m["model"] == "sim")
    assert sum(lane["lag"] + lane["pending"] for lane in sim["lanes"].values()) == 4
    queued = {t["name"]: t["queued"] for t in sim["tenants"]}
    assert queued == {"team-a": 3, "team-b": 1}

    listed = client.get("/v1/admin/keys", headers=_bearer(admin.token))
    assert listed.status_code == 200
    scopes = {k["name"]: k["scope"] for k in listed.json()["data"]}
    assert scopes == {"ops": "admin", "team-a": "client", "team-b": "client"}
    for secret in (admin.token, team_a.token, admin.webhook_secret, "salt", "hash"):
        assert secret not in listed.text


@pytest.fixture
def uncached(settings: Settings) -> Iterator[TestClient]:
    """The API looking keys up at every request (FERRY_KEY_CACHE_S=0)."""
    with TestClient(create_app(settings.model_copy(update={"key_cache_s": 0}))) as test_client:
        yield test_client


def test_revocation_and_rotation_take_effect_at_the_next_request(
    uncached: TestClient, sessions: sessionmaker[Session]
) -> None:
    client = uncached
    with sessions() as session:
        admin = create_key(session, "ops", "admin").token
        team = create_key(session, "team-a")
    job = client.post(
        "/v1/jobs", json={"model": "sim", "input": {"cost": 1}}, headers=_bearer(team.token)
    ).json()
    with sessions() as session:
        rotated = rotate_key(session, team.id)
    assert rotated is not None and rotated.token != team.token
    old = client.get(f"/v1/jobs/{job['id']}", headers=_bearer(team.token))
    assert old.status_code == 401
    # Same key, new token: its jobs are still its own.
    assert client.get(f"/v1/jobs/{job['id']}", headers=_bearer(rotated.token)).status_code == 200

    revoked = client.post(f"/v1/admin/keys/{team.id}/revoke", headers=_bearer(admin))
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    after = client.get(f"/v1/jobs/{job['id']}", headers=_bearer(rotated.token))
    assert after.status_code == 401
    assert after.json()["error"]["message"] == "invalid or revoked API key"
    missing = client.post("/v1/admin/keys/ffffffffffffffff/revoke", headers=_bearer(admin))
    assert missing.status_code == 404


def _ferry(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferry", "keys", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_keys_command_creates_lists_rotates_and_revokes(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env["FERRY_DATA_DIR"] = str(tmp_path)
    made = _ferry(env, "create", "--name", "ops", "--scope", "admin")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    key_id = token.split("_")[1]
    listed = _ferry(env, "list")
    assert listed.returncode == 0
    assert key_id in listed.stdout and "admin" in listed.stdout
    assert token.split("_", 2)[2] not in listed.stdout
    rotated = _ferry(env, "rotate", key_id)
    assert rotated.returncode == 0
    new_token = rotated.stdout.strip().splitlines()[-1]
    assert new_token.startswith(f"fy_{key_id}_") and new_token != token
    assert _ferry(env, "revoke", key_id).returncode == 0
    listed = _ferry(env, "list")
    row = next(line for line in listed.stdout.splitlines() if line.startswith(key_id))
    assert row.split()[4] != "-"  # a revocation date (created is columns 2-3)
    assert _ferry(env, "rotate", key_id).returncode == 1  # a revoked key gets no new token
    assert _ferry(env, "revoke", "nonexistent").returncode == 1
    bad = _ferry(env, "create", "--name", "x", "--scope", "root")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_the_keys_command_sets_a_keys_embeddings_lane(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env["FERRY_DATA_DIR"] = str(tmp_path)
    made = _ferry(env, "create", "--name", "batch", "--embeddings-lane", "bulk")
    assert made.returncode == 0, made.stderr
    key_id = made.stdout.strip().splitlines()[-1].split("_")[1]
    engine = make_engine(Settings(data_dir=tmp_path).sqlalchemy_url)

    def lane() -> str | None:
        with make_sessionmaker(engine)() as session:
            key = session.get(ApiKey, key_id)
            assert key is not None
            return key.embeddings_lane

    try:
        assert lane() == "bulk"
        changed = _ferry(env, "embeddings-lane", key_id, "vip")
        assert changed.returncode == 0 and "vip lane" in changed.stdout
        assert lane() == "vip"
        assert _ferry(env, "embeddings-lane", key_id, "default").returncode == 0
        assert lane() is None
        assert _ferry(env, "embeddings-lane", "nonexistent", "vip").returncode == 1
        bad = _ferry(env, "embeddings-lane", key_id, "fast")
        assert bad.returncode == 2 and "invalid choice" in bad.stderr
    finally:
        engine.dispose()


def test_the_keys_command_sets_a_keys_weight_and_the_admin_api_shows_it(
    tmp_path: Path, client: TestClient, sessions: sessionmaker[Session]
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
    env["FERRY_DATA_DIR"] = str(tmp_path)
    made = _ferry(env, "create", "--name", "heavy")
    assert made.returncode == 0, made.stderr
    key_id = made.stdout.strip().splitlines()[-1].split("_")[1]
    engine = make_engine(Settings(data_dir=tmp_path).sqlalchemy_url)

    def weight() -> float:
        with make_sessionmaker(engine)() as session:
            key = session.get(ApiKey, key_id)
            assert key is not None
            return key.weight

    try:
        assert weight() == 1.0  # every key's, unless set
        changed = _ferry(env, "weight", key_id, "3")
        assert changed.returncode == 0 and "weight 3" in changed.stdout
        assert weight() == 3.0
        refused = _ferry(env, "weight", key_id, "0")  # the others are refused in-process below
        assert refused.returncode == 2
        assert "weight must be above 0 and at most 1000" in refused.stdout, refused.stdout
        assert weight() == 3.0
        assert _ferry(env, "weight", "nonexistent", "2").returncode == 1
    finally:
        engine.dispose()
    with sessions() as session:
        admin = create_key(session, "ops", "admin").token
        team = create_key(session, "team-w")
        for bad in (0.0, -1.0, 1001.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="weight must be above 0 and at most 1000"):
                set_weight(session, team.id, bad)
        assert set_weight(session, team.id, 2.5) is not None
    listed = client.get("/v1/admin/keys", headers=_bearer(admin)).json()["data"]
    assert {k["id"]: k["weight"] for k in listed}[team.id] == 2.5


def test_a_key_revoked_through_the_api_is_refused_at_once_by_that_process(
    client: TestClient, sessions: sessionmaker[Session]
) -> None:
    with sessions() as session:
        admin = create_key(session, "ops", "admin").token
        team = create_key(session, "team-a")
    # Checked once, so kept in the process's key cache (FERRY_KEY_CACHE_S, 5 s).
    assert client.get("/v1/jobs", headers=_bearer(team.token)).status_code == 200
    assert (
        client.post(f"/v1/admin/keys/{team.id}/revoke", headers=_bearer(admin)).status_code == 200
    )
    assert client.get("/v1/jobs", headers=_bearer(team.token)).status_code == 401
