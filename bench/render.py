# The documents' typography (×, –, −, ≥) is what this module writes.
# ruff: noqa: RUF002, RUF003
"""The benchmark figures of the documents, rendered from the results files.

A document marks each rendered region::

    <!-- bench:table NAME -->
    ...what RENDERERS[NAME] makes of bench/results/*.json...
    <!-- /bench:table -->

``python -m bench.render`` rewrites every region of README.md, bench/README.md
and docs/benchmarks.md; ``--check`` only says which differ (a unit test runs
it). ``--results DIR`` renders from another folder, ``--print`` writes the
regions to stdout instead of the documents (how the smoke run proves its
results still render).

A figure measured more than once is the median of the runs with their range,
``1.32× (1.30–1.35)``; a target is met only when every run meets it, so a
range that crosses it reads "not met".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from bench import (
    api,
    backends,
    backfill,
    capacity,
    clients,
    cluster,
    e2e,
    fairness,
    faults,
    generation,
    generation_promises,
    generation_resume,
    generation_stack,
    gpu,
    mutation,
    oip,
    peers,
    pipeline,
    recording,
    sentinel,
    simulate,
    soak,
)
from bench.report import Results
from bench.results import RESULTS, mixed_commits

ROOT = RESULTS.parent.parent
DOCUMENTS = ("README.md", "bench/README.md", "docs/benchmarks.md", "docs/reliability.md")
REGION = re.compile(
    r"(<!-- bench:table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:table -->)", re.S
)
# The results files of one regenerated set; see MANIFEST.json and same_commit_problems.
MANIFEST = RESULTS / "MANIFEST.json"


# --- the README's headline ------------------------------------------------------------------


def render_headline(results: Results) -> list[str]:
    """The README's bullets: each benchmark's headline figure against its target."""
    return [
        simulate.headline_scheduler(results),
        e2e.headline_e2e(results),
        backfill.headline_backfill(results),
        fairness.headline_fairness(results),
        pipeline.headline_pipeline(results),
        api.headline_api(results),
        *backends.headline_backends(results),
        # Measured only where the bench extra (Ray) is installed.
        *([peers.headline_peers(results)] if results.has("peers") else []),
        # Measured only where a GPU was lent (bench/gpu_check.sh).
        *(
            [gpu.headline_gpu(results)]
            if results.has("gpu") and results.has("generation_gpu")
            else []
        ),
    ]


RENDERERS: dict[str, Callable[[Results], list[str]]] = {
    "headline": render_headline,
    "scheduler-capacity": simulate.render_scheduler_capacity,
    "scheduler-runs": simulate.render_scheduler_runs,
    "scheduler-common": simulate.render_scheduler_common,
    "scheduler-targets": simulate.render_scheduler_targets,
    "scheduler-floors": simulate.render_scheduler_floors,
    "scheduler-sensitivity": simulate.render_scheduler_sensitivity,
    "scheduler-baselines": simulate.render_scheduler_baselines,
    "e2e": e2e.render_e2e,
    "e2e-targets": e2e.render_e2e_targets,
    "api": api.render_api,
    "api-targets": api.render_api_targets,
    "clients-raw": clients.render_clients_raw,
    "clients": clients.render_clients,
    "clients-target": clients.render_clients_target,
    "soak": soak.render_soak,
    "backfill-latency": backfill.render_backfill_latency,
    "backfill-throughput": backfill.render_backfill_throughput,
    "backfill-target": backfill.render_backfill_target,
    "fairness": fairness.render_fairness,
    "backends": backends.render_backends,
    "pipeline": pipeline.render_pipeline,
    "recording": recording.render_recording,
    "sentinel": sentinel.render_sentinel,
    "cluster": cluster.render_cluster,
    "capacity": capacity.render_capacity,
    "peers": peers.render_peers,
    "mutation": mutation.render_mutation,
    "generation": generation.render_generation,
    "generation-targets": generation.render_generation_targets,
    "generation-chunked": generation.render_generation_chunked,
    "generation-profile": generation.render_generation_profile,
    "generation-prefix": generation.render_generation_prefix,
    "generation_stack": generation_stack.render_generation_stack,
    "generation_promises": generation_promises.render_generation_promises,
    "generation_resume": generation_resume.render_generation_resume,
    "generation_gpu": generation.render_generation_gpu,
    "generation_offline": generation.render_generation_offline,
    "oip": oip.render_oip,
    "gpu": gpu.render_gpu,
    "faults": faults.render_faults,
    "faults-generation": faults.render_faults_generation,
}


# The results files each region reads (what a document cites).
HEADLINE_SOURCES = (
    "scheduler", "e2e", "backfill", "fairness", "pipeline", "api", "backends", "peers",
)  # fmt: skip


SOURCES: dict[str, tuple[str, ...]] = {
    "headline": HEADLINE_SOURCES,
    **{name: (name.split("-")[0],) for name in RENDERERS if name != "headline"},
}


# --- documents ------------------------------------------------------------------------------


def render_text(text: str, results: Results) -> str:
    """``text`` with every region rendered anew."""

    def one(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise KeyError(f"no renderer for the region {name!r}")
        body = "\n".join(RENDERERS[name](results))
        return f"{match[1]}{body}\n{match[4]}"

    return REGION.sub(one, text)


def regions(text: str) -> list[str]:
    return [match["name"] for match in REGION.finditer(text)]


def stale(root: Path, results: Results) -> list[str]:
    """The documents whose regions differ from what their results render."""
    found = []
    for name in DOCUMENTS:
        text = (root / name).read_text(encoding="utf-8")
        if render_text(text, results) != text:
            found.append(name)
    return found


def cited(root: Path) -> set[str]:
    """The results files the documents' regions read."""
    names: set[str] = set()
    for document in DOCUMENTS:
        for region in regions((root / document).read_text(encoding="utf-8")):
            names.update(SOURCES[region])
    return names


def same_commit_enforced(manifest: Path = MANIFEST) -> bool:
    return bool(json.loads(manifest.read_text()).get("same_commit"))


def same_commit_problems(root: Path, results: Results) -> list[str]:
    """The cited results files that are not one set measured at one commit."""
    return mixed_commits({name: results[name] for name in sorted(cited(root))})


def render_all(results: Results) -> str:
    """Every region, whatever document holds it (a missing results file said so)."""
    parts = []
    for name, render in RENDERERS.items():
        try:
            body = "\n".join(render(results))
        except FileNotFoundError as missing:
            body = f"(no results file: {Path(missing.filename or '').name})"
        parts.append(f"<!-- bench:table {name} -->\n{body}\n<!-- /bench:table -->\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say what is out of date")
    parser.add_argument("--print", action="store_true", help="every region to stdout")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder")
    args = parser.parse_args(argv)
    results = Results(args.results)
    if args.print:
        print(render_all(results))
        return 0
    out_of_date = stale(ROOT, results)
    if args.check:
        for name in out_of_date:
            print(
                f"{name}: its benchmark figures differ from bench/results (python -m bench.render)"
            )
        return 1 if out_of_date else 0
    for name in out_of_date:
        path = ROOT / name
        path.write_text(render_text(path.read_text(encoding="utf-8"), results), encoding="utf-8")
        print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
