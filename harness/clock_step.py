"""One process's wall clock stepped, as an NTP step moves a host's: libfaketime preloaded.

libfaketime (``LD_PRELOAD``) answers the process's ``clock_gettime`` and
``gettimeofday`` with the real time plus the offset a file holds, read again
once a second (``FAKETIME_CACHE_DURATION``), so rewriting it steps the clock of
the running process within a second (``+300``: five minutes ahead; ``+0``:
back). Not at every call (``FAKETIME_NO_CACHE``): that opens and reads the file
at each of the thousands of clock readings a second a busy API makes, under a
lock its threads queue on, and on some hosts made a 10 s scenario take minutes.
``DONT_FAKE_MONOTONIC`` leaves ``CLOCK_MONOTONIC`` alone, as a step of
``CLOCK_REALTIME`` does: Python's ``time.time()`` and ``datetime.now()``
jump, ``time.monotonic()`` does not.

The library comes from the ``libfaketime`` package on PyPI (it bundles
``libfaketime.so.1``), or from Debian's ``faketime`` package.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
from pathlib import Path

from harness.processes import Proc

DEBIAN_LIBRARY = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def library() -> Path | None:
    """The libfaketime shared object to preload, or None when neither source is installed."""
    with contextlib.suppress(ImportError):
        import libfaketime

        bundled = Path(libfaketime.__file__).parent / "vendor/libfaketime/src/libfaketime.so.1"
        if bundled.is_file():
            return bundled
    return DEBIAN_LIBRARY if DEBIAN_LIBRARY.is_file() else None


class SteppedClock:
    """A wall clock offset by what ``file`` holds, for the processes given :meth:`env`."""

    LAG_S = 1  # the most a step takes to reach them (whole seconds, as libfaketime reads it)

    def __init__(self, folder: Path, so: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.file = folder / "faketime"
        self.so = so
        self.offset_s = 0.0
        self.step(0)

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(self.so),
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_CACHE_DURATION": str(self.LAG_S),
            "DONT_FAKE_MONOTONIC": "1",
        }

    def step(self, offset_s: float) -> None:
        """Within ``LAG_S`` the clock reads the real time plus ``offset_s`` (written whole:
        a rename, so that no read finds the file half written)."""
        staged = self.file.with_suffix(".new")
        staged.write_text(f"{offset_s:+.0f}\n")
        os.replace(staged, self.file)
        self.offset_s = offset_s


def logged_times(proc: Proc) -> list[dt.datetime]:
    """The times a Ferry process's own log lines carry (its wall clock, as it stood)."""
    times = []
    for line in proc.log.read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            times.append(dt.datetime.fromisoformat(json.loads(line)["ts"]))
    return times
