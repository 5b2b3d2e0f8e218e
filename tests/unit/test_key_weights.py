"""workers.gpu.key_weights: the keys' weights a generation worker shares its engine by."""

from __future__ import annotations

from typing import Any

from sqlalchemy.exc import OperationalError

from workers.gpu.key_weights import KeyWeights


class Rows:
    """A sessionmaker whose sessions answer the weights query with ``rows``, or fail."""

    def __init__(self, rows: dict[str, float]) -> None:
        self.rows = rows
        self.down = False
        self.reads = 0

    def __call__(self) -> Rows:
        self.reads += 1
        if self.down:
            raise OperationalError("SELECT", {}, ConnectionError("the database is down"))
        return self

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def execute(self, _query: Any) -> Rows:
        return self

    def all(self) -> list[Any]:
        return [type("Row", (), {"id": k, "weight": w}) for k, w in self.rows.items()]


def test_weights_are_read_once_a_refresh_and_a_failed_read_keeps_the_last() -> None:
    now = [0.0]
    rows = Rows({"heavy": 3.0})
    weights = KeyWeights(rows, refresh_s=10, clock=lambda: now[0])  # type: ignore[arg-type]
    assert (weights.of("heavy"), weights.of("other"), weights.of(None)) == (3.0, 1.0, 1.0)
    assert rows.reads == 1  # read once for all three
    rows.rows = {"heavy": 5.0}
    now[0] = 9.9
    assert weights.of("heavy") == 3.0 and rows.reads == 1
    now[0] = 10.0
    assert weights.of("heavy") == 5.0 and rows.reads == 2
    rows.down = True
    now[0] = 20.0
    assert weights.of("heavy") == 5.0  # the database is down: the last read stands
    rows.down = False
    now[0] = 25.0
    assert weights.of("heavy") == 5.0 and rows.reads == 3  # tried again a refresh later
    now[0] = 30.0
    assert weights.of("heavy") == 5.0 and rows.reads == 4
