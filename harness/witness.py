"""Witnesses of what happened to jobs, kept outside the code under test.

Two records the fault suite counts from, neither written by the worker's
own bookkeeping:

- **Transitions**, in the test's database: a trigger on ``jobs`` logs every
  job inserted and every update that changes its ``status`` or sets a
  terminal one (``witness_transitions``: job id, old status, new status,
  when). It is installed by the harness in the test's own database after
  migration, never by Ferry's migrations. It sees every committed write,
  whoever makes it and whether or not anything announces it: a job whose
  row was made terminal twice has two terminal transitions.
- **Computations**, by the sim model (``backends.sim``, ``witness_dir``):
  every batch it computed, with each input's tag and the nonce it put in
  that output.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Engine, text

from core.db.schema import TERMINAL_STATUSES

TABLE = "witness_transitions"
_TERMINAL = ", ".join(f"'{status}'" for status in TERMINAL_STATUSES)

_POSTGRESQL = [
    f"""CREATE TABLE {TABLE} (
        id BIGSERIAL PRIMARY KEY,
        job_id VARCHAR(36) NOT NULL,
        old_status VARCHAR(16),
        new_status VARCHAR(16) NOT NULL,
        at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
    )""",
    f"CREATE INDEX {TABLE}_job ON {TABLE} (job_id)",
    f"""CREATE FUNCTION {TABLE}_log() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF TG_OP = 'INSERT' THEN
            INSERT INTO {TABLE} (job_id, old_status, new_status) VALUES (NEW.id, NULL, NEW.status);
        ELSIF NEW.status IS DISTINCT FROM OLD.status OR NEW.status IN ({_TERMINAL}) THEN
            INSERT INTO {TABLE} (job_id, old_status, new_status)
                VALUES (NEW.id, OLD.status, NEW.status);
        END IF;
        RETURN NULL;
    END $$""",
    f"""CREATE TRIGGER {TABLE}_log AFTER INSERT OR UPDATE OF status ON jobs
        FOR EACH ROW EXECUTE FUNCTION {TABLE}_log()""",
]

_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_SQLITE = [
    f"""CREATE TABLE {TABLE} (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        job_id VARCHAR(36) NOT NULL,
        old_status VARCHAR(16),
        new_status VARCHAR(16) NOT NULL,
        at TEXT NOT NULL
    )""",
    f"CREATE INDEX {TABLE}_job ON {TABLE} (job_id)",
    f"""CREATE TRIGGER {TABLE}_insert AFTER INSERT ON jobs FOR EACH ROW BEGIN
        INSERT INTO {TABLE} (job_id, old_status, new_status, at)
            VALUES (NEW.id, NULL, NEW.status, {_NOW});
    END""",
    f"""CREATE TRIGGER {TABLE}_update AFTER UPDATE OF status ON jobs FOR EACH ROW
        WHEN NEW.status IS NOT OLD.status OR NEW.status IN ({_TERMINAL}) BEGIN
        INSERT INTO {TABLE} (job_id, old_status, new_status, at)
            VALUES (NEW.id, OLD.status, NEW.status, {_NOW});
    END""",
]


def install_transition_witness(engine: Engine) -> None:
    """Create the transitions table and the trigger that fills it (a migrated database)."""
    statements = {"postgresql": _POSTGRESQL, "sqlite": _SQLITE}[engine.dialect.name]
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


@dataclass(frozen=True)
class Transition:
    job_id: str
    old_status: str | None
    new_status: str
    at: dt.datetime | str


def read_transitions(engine: Engine, ids: Iterable[str]) -> dict[str, list[Transition]]:
    """The transitions of each of ``ids`` (those with none are absent), in the order logged."""
    found: dict[str, list[Transition]] = defaultdict(list)
    wanted = list(ids)
    # Each chunk's read a transaction of its own: one held open across them would sit
    # idle between reads, and a reader descheduled on a loaded host for longer than
    # core.db.schema.IDLE_IN_TRANSACTION_S would see its connection ended by the server.
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        for start in range(0, len(wanted), 1000):
            chunk = wanted[start : start + 1000]
            marks = ", ".join(f":j{i}" for i in range(len(chunk)))
            rows = conn.execute(
                text(
                    f"SELECT job_id, old_status, new_status, at FROM {TABLE} "
                    f"WHERE job_id IN ({marks}) ORDER BY id"
                ),
                {f"j{i}": job_id for i, job_id in enumerate(chunk)},
            )
            for job_id, old, new, at in rows:
                found[job_id].append(Transition(job_id, old, new, at))
    return dict(found)


def terminal_writes(transitions: dict[str, list[Transition]]) -> dict[str, int]:
    """How many times each job was made terminal (a job never made terminal is absent)."""
    counts = {
        job_id: sum(1 for t in seen if t.new_status in TERMINAL_STATUSES)
        for job_id, seen in transitions.items()
    }
    return {job_id: n for job_id, n in counts.items() if n}
