"""The README is the front door: every link in it leads somewhere in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_readme_exists() -> None:
    targets = LINK.findall((ROOT / "README.md").read_text(encoding="utf-8"))
    local = [target.split("#")[0] for target in targets if "://" not in target]
    assert local, "the README links into docs/"
    missing = [target for target in local if target and not (ROOT / target).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
