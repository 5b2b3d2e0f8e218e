"""promtool, from Debian's prometheus package (.ci/run installs it), for the tests of
deploy/prometheus and of the KEDA queries. Missing, it is a missing service: the
test skips, or fails under CI=true (tests/conftest.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from harness.services import ServiceMissing


def promtool(*args: str, cwd: Path) -> None:
    """Run promtool with ``args`` in ``cwd``; fail with its output unless it exits 0."""
    found = shutil.which("promtool")
    if found is None:
        raise ServiceMissing(
            "promtool is not installed (apt-get install prometheus; .ci/run installs it)"
        )
    done = subprocess.run(
        [found, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
