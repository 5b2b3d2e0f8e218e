"""Wait until the database's schema is the one this image's code expects.

The init container of every Ferry pod that reads or writes jobs runs this
(mounted from the ferry-scripts ConfigMap), so that no process starts on a
schema the migration Job has not brought up to date yet. It only reads the
Alembic revision: any number of pods may wait at once. Exits 0 once the
database is at this code's newest revision, or past it (a newer image's Job
ran first: its pods are the ones rolling out); 1 after
FERRY_SCHEMA_WAIT_S (600 s) without, and the kubelet starts it again.
"""

from __future__ import annotations

import os
import sys
import time

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from core.config.settings import get_settings
from core.db.migrate import alembic_config
from core.db.schema import make_engine

POLL_S = 2.0


def schema_state(url: str) -> str:
    """'current', 'behind' (no schema, or an older revision) or 'ahead' (one this code lacks)."""
    script = ScriptDirectory.from_config(alembic_config(url))
    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            current = set(MigrationContext.configure(connection).get_current_heads())
    finally:
        engine.dispose()
    if not current:
        return "behind"
    known = {revision.revision for revision in script.walk_revisions()}
    if not current <= known:
        return "ahead"
    return "current" if current == set(script.get_heads()) else "behind"


def main() -> int:
    url = get_settings().sqlalchemy_url
    limit_s = float(os.environ.get("FERRY_SCHEMA_WAIT_S", "600"))
    start = time.monotonic()
    said = ""
    while True:
        try:
            state = schema_state(url)
        except Exception as exc:  # the database not reachable yet: wait for it too
            state = f"unreachable ({type(exc).__name__})"
        if state in ("current", "ahead"):
            print(f"database schema {state}", flush=True)
            return 0
        if state != said:
            print(f"waiting for the migration Job: database schema {state}", flush=True)
            said = state
        if time.monotonic() - start >= limit_s:
            print(f"gave up after {limit_s:.0f} s: database schema {state}", file=sys.stderr)
            return 1
        time.sleep(POLL_S)


if __name__ == "__main__":
    sys.exit(main())
