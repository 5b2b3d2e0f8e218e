"""Which version of a model is active, and what each worker is doing with each version.

The active version is the one new jobs run on: the version an operator
activated (a row in ``model_activations``, by ``ferry models activate`` or
the admin endpoint) when that version is in the repository, else the one
model.toml names (``active_version``, or the highest). Activating an older
version is a rollback; it is the same operation.

An operator may also unload a model (a row in ``model_unloads``, by the
inference protocol's repository extension): the API then takes no new jobs
for it, whatever its version, until it is loaded again. Workers are not
told: they finish the jobs already accepted, and an autoscaler that follows
the queue takes them away once it is empty.

Each worker reports its versions' states to Redis (``loading``, ``ready``,
``draining``, ``failed`` with the reason); ``GET /v1/models`` shows them
gathered over the live workers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.db.schema import ModelActivation, ModelUnload, utcnow
from core.models.repository import ModelConfig
from core.streams.protocol import versions_key, workers_key
from core.streams.queues import HEARTBEAT_TTL_S

STATES = ("loading", "ready", "draining", "failed")
# A failed load is shown this long after the worker that tried it is gone.
FAILED_SHOWN_S = 3600.0


class ActivationError(ValueError):
    pass


def activated_version(session: Session, model: str) -> int | None:
    """The version an operator activated, if any."""
    return session.scalar(select(ModelActivation.version).where(ModelActivation.model == model))


def active_version(session: Session, model: ModelConfig) -> int:
    """The version new jobs of ``model`` run on (an activation of a missing version is ignored)."""
    chosen = activated_version(session, model.name)
    return chosen if chosen is not None and chosen in model.versions else model.active_version


def activate(session: Session, model: ModelConfig, version: int) -> None:
    """Make ``version`` the active one; workers switch to it within their poll interval."""
    if version not in model.versions:
        known = ", ".join(map(str, sorted(model.versions)))
        raise ActivationError(f"{model.name} has no version {version} (versions: {known})")
    for _attempt in range(2):
        row = session.get(ModelActivation, model.name)
        if row is None:
            session.add(ModelActivation(model=model.name, version=version, updated_at=utcnow()))
        else:
            row.version = version
            row.updated_at = utcnow()
        try:
            session.commit()
            return
        except IntegrityError:
            # Another activation made the row first: this one updates it.
            session.rollback()
    raise ActivationError(f"{model.name}: the activation could not be written; try again")


def unloaded_models(session: Session) -> set[str]:
    """The models an operator unloaded."""
    return set(session.scalars(select(ModelUnload.model)))


def unload(session: Session, model: str) -> None:
    """Take no new jobs for ``model`` until :func:`load`; unloading it again changes nothing."""
    if session.get(ModelUnload, model) is not None:
        return
    session.add(ModelUnload(model=model, unloaded_at=utcnow()))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()  # another unload wrote it first: unloaded all the same


def load(session: Session, model: str) -> None:
    """Take jobs for ``model`` again after :func:`unload` (on its active version)."""
    session.execute(delete(ModelUnload).where(ModelUnload.model == model))
    session.commit()


@dataclass(frozen=True)
class VersionState:
    state: str  # loading | ready | draining | failed | available
    reason: str | None = None
    workers: int = 0  # live workers in this state


def report(
    client: redis.Redis,
    prefix: str,
    model: str,
    consumer: str,
    version: int,
    state: str | None,
    reason: str | None = None,
) -> None:
    """One worker's state of one version (None: it holds that version no more)."""
    field = f"{version}|{consumer}"
    if state is None:
        client.hdel(versions_key(prefix, model), field)
        return
    value = json.dumps({"state": state, "reason": reason, "at": time.time()})
    client.hset(versions_key(prefix, model), field, value)


def version_states(
    client: redis.Redis, prefix: str, model: str, now: float | None = None
) -> dict[int, VersionState]:
    """Per version, what the model's live workers report (a failure also from gone ones).

    A version some live worker serves is ``ready``; else ``loading`` or
    ``draining`` if one is doing that; else ``failed`` if a worker could not
    load it (with its reason). Versions no worker reports are absent.
    """
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(versions_key(prefix, model))
    pipe.zrangebyscore(workers_key(prefix, model), now - HEARTBEAT_TTL_S, "+inf")
    raw, live_raw = pipe.execute()
    live = {_text(c) for c in live_raw}
    seen: dict[int, dict[str, list[str | None]]] = {}
    for field_raw, value_raw in raw.items():
        version_text, _, consumer = _text(field_raw).partition("|")
        try:
            version = int(version_text)
            value = json.loads(_text(value_raw))
            state, at = str(value["state"]), float(value["at"])
        except (ValueError, KeyError, TypeError):
            continue
        if consumer in live or (state == "failed" and now - at < FAILED_SHOWN_S):
            seen.setdefault(version, {}).setdefault(state, []).append(value.get("reason"))
    states: dict[int, VersionState] = {}
    for version, by_state in seen.items():
        for state in ("ready", "loading", "draining", "failed"):
            if state in by_state:
                reasons = [r for r in by_state[state] if r]
                states[version] = VersionState(
                    state, reasons[0] if reasons else None, len(by_state[state])
                )
                break
    return states


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
