"""The pins of the bench extra (bench/constraints.txt) are used together with the project's
(constraints.txt) by `make bench-peers`: a package pinned in both at different versions
makes that install impossible."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"{path.name}: {line!r} is not an exact pin"
            found[re.sub(r"[-_.]+", "-", name).lower()] = version
    return found


def test_a_package_pinned_in_both_files_is_pinned_at_one_version() -> None:
    project, bench = pins(ROOT / "constraints.txt"), pins(ROOT / "bench" / "constraints.txt")
    differ = {
        name: (project[name], bench[name])
        for name in project.keys() & bench.keys()
        if project[name] != bench[name]
    }
    assert not differ, f"pinned differently (constraints.txt, bench/constraints.txt): {differ}"
