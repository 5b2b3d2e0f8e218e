"""Each API key's weight, as a generation worker's scheduler shares its engine by.

Keys are many and their weights rarely change, so the worker keeps the
weights that are not the default (1) and reads them again at most every
``refresh_s``, on the loop's thread, in one small query; a key not among them
weighs 1. A read that fails keeps the last one (a database outage must not
stop the generations running), and is tried again a refresh later.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from core.db.schema import ApiKey

log = logging.getLogger(__name__)

REFRESH_S = 10.0


class KeyWeights:
    """``of(key_id)``: the key's weight, as read at most ``refresh_s`` ago."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.refresh_s = refresh_s
        self.clock = clock
        self._weights: dict[str, float] = {}
        self._read_at = -float("inf")

    def of(self, key_id: str | None) -> float:
        now = self.clock()
        if now - self._read_at >= self.refresh_s:
            self._read_at = now
            try:
                with self.sessions() as session:
                    rows = session.execute(
                        select(ApiKey.id, ApiKey.weight).where(ApiKey.weight != 1.0)
                    ).all()
                self._weights = {row.id: float(row.weight) for row in rows}
            except SQLAlchemyError as exc:
                log.warning(
                    "the keys' weights could not be read; the last ones stand",
                    extra={"error_type": type(exc).__name__},
                )
        return self._weights.get(key_id or "", 1.0)
