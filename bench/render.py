# The documents' typography (×, –, −, ≥) is what this module writes.
# ruff: noqa: RUF001, RUF002, RUF003
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
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import RESULTS, mixed_commits

ROOT = RESULTS.parent.parent
DOCUMENTS = ("README.md", "bench/README.md", "docs/benchmarks.md", "docs/reliability.md")
REGION = re.compile(
    r"(<!-- bench:table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:table -->)", re.S
)
# The results files of one regenerated set; see MANIFEST.json and same_commit_problems.
MANIFEST = RESULTS / "MANIFEST.json"

Doc = dict[str, Any]
DEFAULT_SIMULATE = "python -m bench.simulate"


class Results:
    """The results files of a folder, read once each, by name (``api`` is api.json)."""

    def __init__(self, folder: Path, smoke: bool = False) -> None:
        self.folder = folder
        self.smoke = smoke  # a smoke run's files are read only to prove they still render
        self.read: dict[str, Doc] = {}

    def __getitem__(self, name: str) -> Doc:
        if name not in self.read:
            doc = json.loads((self.folder / f"{name}.json").read_text())
            if doc.get("smoke") and not self.smoke:
                raise ValueError(f"{name}.json is a smoke run's: its figures mean nothing")
            self.read[name] = doc
        return self.read[name]

    def has(self, name: str) -> bool:
        """Whether the folder holds ``name``'s file (a benchmark that needs an extra may not)."""
        return name in self.read or (self.folder / f"{name}.json").exists()


# --- figures ------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One figure over the runs that measured it."""

    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Figure:
        return cls(tuple(values))

    @classmethod
    def summary(cls, spread: Mapping[str, float]) -> Figure:
        """From a results file's {median, min, max} (rounds it already summarised)."""
        if spread["min"] == spread["max"]:
            return cls((spread["median"],))
        return cls((spread["min"], spread["median"], spread["max"]))

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    @property
    def low(self) -> float:
        return min(self.runs)

    @property
    def high(self) -> float:
        return max(self.runs)

    def text(self, fmt: Fmt, bold: bool = False) -> str:
        """The median (bold if asked), then the runs' range where there were several."""
        shown = f"**{fmt(self.median)}**" if bold else fmt(self.median)
        if len(self.runs) < 2:
            return shown
        return f"{shown} ({fmt.bare(self.low)}–{fmt.bare(self.high)})"

    def meets(self, target: float, at_least: bool) -> bool:
        """Every run meets the target: a range that crosses it does not."""
        return self.low >= target if at_least else self.high <= target


@dataclass(frozen=True)
class Fmt:
    """How a figure is written: ``1,586``, ``41.6 %``, ``1.87×``; bare, without the unit."""

    digits: int = 0
    suffix: str = ""
    scale: float = 1.0

    def bare(self, value: float) -> str:
        return f"{self.scale * value:,.{self.digits}f}"

    def __call__(self, value: float) -> str:
        return self.bare(value) + self.suffix


def number(digits: int = 0, suffix: str = "") -> Fmt:
    return Fmt(digits, suffix)


def percent(digits: int = 0) -> Fmt:
    return Fmt(digits, " %", 100.0)


def times(digits: int = 2) -> Fmt:
    return Fmt(digits, "×")


def batches(count: int) -> str:
    return {0: "no batch", 1: "one batch"}.get(count, f"{count:,} batches")


def verdict(met: bool) -> str:
    return "met" if met else "**not met**"


def runs_of(doc: Doc, key: str = "runs") -> list[Doc]:
    """A repeated benchmark's runs; a file of one run (written before repeats) is its own."""
    found = doc.get(key)
    return list(found) if isinstance(found, list) else [doc]


def day(doc: Doc) -> str:
    return str(doc["date"])[:10]


def machine_text(doc: Doc) -> str:
    """The machine as a results file recorded it (older files recorded less)."""
    found = doc.get("machine")
    if isinstance(found, str):
        return found
    if not isinstance(found, dict):
        return "machine not recorded"
    cores = found.get("cores") or found.get("cpu_count")
    parts = [found.get("cpu") or found.get("machine") or found.get("arch"), f"{cores} cores"]
    if found.get("memory_gib"):
        parts.append(f"{found['memory_gib']} GiB")
    parts.append(found["gpu"] if found.get("gpu") else "no GPU")
    return ", ".join(str(p) for p in parts if p)


def commit_text(doc: Doc) -> str:
    git = doc.get("git")
    commit = git.get("commit") if isinstance(git, dict) else doc.get("commit")
    return f"commit {commit[:7]}" if commit else "commit not recorded"


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table; ``align`` has one letter a column, l or r."""
    marks = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# --- the scheduler simulation (scheduler.json) -------------------------------------------


def scheduler_seeds(doc: Doc) -> list[Doc]:
    """Seed by seed, the capacities and the targets; a file of one seed has them at the top."""
    if "seeds" in doc:
        return list(doc["seeds"])
    capacity = {n: doc["policies"][n]["capacity_per_s"] for n in ("fixed", "ferry")}
    return [{"seed": doc["seed"], "capacity_per_s": capacity, "targets": doc["targets"]}]


def scheduler_targets(doc: Doc) -> dict[str, Figure]:
    seeds = scheduler_seeds(doc)

    def over(get: Callable[[Doc], float]) -> Figure:
        return Figure.of(get(s) for s in seeds)

    return {
        "capacity_ratio": over(lambda s: s["targets"]["capacity_vs_fixed"]["value"]),
        "ferry_capacity": over(lambda s: s["capacity_per_s"]["ferry"]),
        "fixed_capacity": over(lambda s: s["capacity_per_s"]["fixed"]),
        "efficiency": over(lambda s: s["targets"]["efficiency_at_80"]["value"]),
        "efficiency_cost": over(lambda s: s["targets"]["efficiency_at_80"]["cost_weighted"]),
        "efficiency_95": over(lambda s: s["targets"]["efficiency_at_80"]["at_95"]),
        "urgent_ratio": over(lambda s: s["targets"]["urgent_p99_80_over_10"]["value"]),
        "urgent_10": over(lambda s: s["targets"]["urgent_p99_80_over_10"]["p99_10_ms"]),
        "urgent_80": over(lambda s: s["targets"]["urgent_p99_80_over_10"]["p99_80_ms"]),
        "misses": over(lambda s: s["targets"]["deadline_misses_le_90"]["value"]),
    }


def _run_at(doc: Doc, policy: str, trace: str, load: float) -> Doc:
    from bench.simulate import _run_at as run_at

    return run_at(doc["policies"][policy], trace, load)


def render_scheduler_capacity(results: Results) -> list[str]:
    doc = results["scheduler"]
    seeds = len(scheduler_seeds(doc))
    command = doc.get("command", DEFAULT_SIMULATE)
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; model `{doc['model']['name']}`, "
        f"seed {doc['seed']}"
        + (
            f" (the targets over seeds {doc['seed']} to {doc['seed'] + seeds - 1})"
            if seeds > 1
            else ""
        )
        + f", {doc['seconds']:.0f} s, `{command}`.",
        "",
        "Sustainable throughput (Poisson):",
        "",
    ]
    fixed = doc["policies"]["fixed"]["capacity_per_s"]
    rows = []
    for name, policy in doc["policies"].items():
        ratio = f"{policy['capacity_per_s'] / fixed:.2f}×"
        rows.append(
            [name, f"{policy['capacity_per_s']:,.0f}", f"**{ratio}**" if name == "ferry" else ratio]
        )
    return lines + table(["policy", "capacity (jobs/s)", "vs fixed"], "lrr", rows)


def render_scheduler_runs(results: Results) -> list[str]:
    from bench.simulate import RUN_HEADER, _row

    doc = results["scheduler"]
    lines = list(RUN_HEADER)
    for name, policy in doc["policies"].items():
        for run in policy["runs"]:
            label = f"{run['load']:.0%}" + ("" if run["trace"] == "poisson" else f" {run['trace']}")
            lines.append(_row(name, label, run))
    return lines


def render_scheduler_common(results: Results) -> list[str]:
    from bench.simulate import RUN_HEADER, _row

    doc = results["scheduler"]
    fixed = doc["policies"]["fixed"]["capacity_per_s"]
    lines = [
        f"At a common rate, {doc['common_rate']:,.0f} jobs/s "
        f"({doc['common_rate'] / fixed:.0%} of the fixed baseline's capacity):".replace("%", " %"),
        "",
        RUN_HEADER[0].replace("| load |", "| load of own capacity |"),
        RUN_HEADER[1],
    ]
    for name, policy in doc["policies"].items():
        lines.append(_row(name, f"{policy['common']['load']:.0%}", policy["common"]))
    return lines


def render_scheduler_targets(results: Results) -> list[str]:
    doc = results["scheduler"]
    t = scheduler_targets(doc)
    by_run = doc["targets"]["deadline_misses_le_90"]["by_run"]
    steady = max(v for k, v in by_run.items() if not k.startswith("bursty"))
    bursty = max(v for k, v in by_run.items() if k.startswith("bursty"))
    at_90 = _run_at(doc, "ferry", "poisson", 0.9)["efficiency_mean"]
    seeds = len(scheduler_seeds(doc))
    pct = percent(2)

    def yes(met: bool) -> str:
        return "yes" if met else "**no**"

    rows = [
        [
            "Ferry capacity ≥ 1.3 × fixed batching",
            f"{t['capacity_ratio'].text(times())} ({t['ferry_capacity'].median:,.0f} vs "
            f"{t['fixed_capacity'].median:,.0f} jobs/s)",
            yes(t["capacity_ratio"].meets(1.3, at_least=True)),
        ],
        [
            "Ferry batch efficiency ≥ 0.9 (at 80 % load)",
            f"{t['efficiency'].text(number(3))} (cost-weighted {t['efficiency_cost'].median:.2f};"
            f" {at_90:.2f} at 90 % and {t['efficiency_95'].median:.2f} at 95 %)".replace(
                f"{at_90:.2f} at 90 % and {at_90:.2f} at 95 %", f"{at_90:.2f} at 90 % and 95 %"
            ),
            yes(t["efficiency"].meets(0.9, at_least=True)),
        ],
        [
            "Ferry urgent p99 at 80 % ≤ 1.2 × at 10 %",
            f"{t['urgent_80'].median:.1f} / {t['urgent_10'].median:.1f} ms = "
            f"{t['urgent_ratio'].text(number(2))}",
            yes(t["urgent_ratio"].meets(1.2, at_least=False)),
        ],
        [
            "Deadline misses ≤ 1 % at ≤ 90 % load",
            f"{pct(steady)} on Poisson and uniform traces; {pct(bursty)} on the bursty trace"
            " at 90 %" + (f"; at most {pct(t['misses'].high)} over the seeds" if seeds > 1 else ""),
            yes(t["misses"].meets(0.01, at_least=False)),
        ],
    ]
    return table(["target", "value", "met"], "lrl", rows)


def render_scheduler_floors(results: Results) -> list[str]:
    from bench.simulate import SHORT_HEADER, _short_row

    doc = results["scheduler"]
    fixed = doc["policies"]["fixed"]["capacity_per_s"]
    return list(SHORT_HEADER) + [
        _short_row(name, report, fixed) for name, report in doc["efficiency_floors"].items()
    ]


def render_scheduler_baselines(results: Results) -> list[str]:
    from bench.simulate import SHORT_HEADER, _short_row
    from bench.simulate import _run_at as run_at

    doc = results["scheduler"]
    baselines = doc["baselines"]
    default = doc["policies"]["fixed"]["capacity_per_s"]
    fixed = {n: r for n, r in baselines.items() if n.startswith("fixed")}
    best = max(fixed, key=lambda n: fixed[n]["capacity_per_s"])
    best_capacity = fixed[best]["capacity_per_s"]
    shipped = baselines["ferry, shipped defaults"]["capacity_per_s"]
    tuned = baselines["ferry, tuned"]["capacity_per_s"]
    # The size its worker derived; results from before it was derived had a fixed 32.
    derived = run_at(baselines["ferry, shipped defaults"], "poisson", 0.8).get("max_batch_size")
    size = (
        "batches of up to 32"
        if derived is None
        else f"the batch size its worker derives from the model's latency, here {derived}"
    )
    return [
        f"Fixed batching at its best over the grid is **{best}**: {best_capacity:,.0f} jobs/s, "
        f"{best_capacity / default:.2f}× its 32 / 5 ms default. Ferry as it ships ({size}, "
        f"no cost cap) sustains {shipped:,.0f} jobs/s, "
        f"**{shipped / best_capacity:.2f}×** the best fixed batching; tuned (batches of up to "
        f"256 capped at 8,192 padded tokens) {tuned:,.0f} jobs/s, "
        f'**{tuned / best_capacity:.2f}×**. "vs fixed" below is against the 32 / 5 ms default.',
        "",
        *SHORT_HEADER,
        *(_short_row(name, report, default) for name, report in baselines.items()),
    ]


def render_scheduler_sensitivity(results: Results) -> list[str]:
    from bench.simulate import SHORT_HEADER, _short_row

    policies = results["scheduler"]["sensitivity"]["policies"]
    fixed = policies["fixed"]["capacity_per_s"]
    return list(SHORT_HEADER) + [
        _short_row(name, report, fixed) for name, report in policies.items()
    ]


# --- end to end (e2e.json) -------------------------------------------------------------


def e2e_ratios(round_: Doc) -> dict[str, dict[str, float]]:
    """A round's ratios (files written before rounds did not keep them)."""
    if "ratios" in round_:
        return dict(round_["ratios"])
    from bench.e2e import ModeResult, Phase, Round, ratios

    modes = [
        ModeResult(m["mode"], m["submit_per_s"], Phase(**m["drain"]), Phase(**m["live"]))
        for m in round_["modes"]
    ]
    return ratios(Round(1, round_["raw_by_batch"], round_["raw_ceiling"], modes))


def e2e_figures(doc: Doc) -> dict[str, dict[str, Figure]]:
    rounds = runs_of(doc, "rounds")
    per_round = [e2e_ratios(r) for r in rounds]
    figures: dict[str, dict[str, Figure]] = {}
    for mode in per_round[0]:
        found = {k: Figure.of(r[mode][k] for r in per_round) for k in per_round[0][mode]}
        for phase in ("drain", "live"):
            found[f"{phase}_jobs_per_s"] = Figure.of(
                next(m for m in r["modes"] if m["mode"] == mode)[phase]["jobs_per_s"]
                for r in rounds
            )
        figures[mode] = found
    figures["raw"] = {
        "ceiling": Figure.of(r["raw_ceiling"] for r in rounds),
        "gain": Figure.of(r["raw_ceiling"] / r["raw_by_batch"]["1"] for r in rounds),
    }
    return figures


def render_e2e(results: Results) -> list[str]:
    doc = results["e2e"]
    rounds = runs_of(doc, "rounds")
    first = rounds[0]
    raw = first["raw_by_batch"]
    best = max(raw, key=lambda k: raw[k])
    shown = [
        f"**{raw[k]:.0f} at {k}** (the ceiling)" if k == best else f"{raw[k]:.0f} at {k}"
        for k in raw
    ]
    shown[0] = shown[0].replace(" at ", " texts/s at batch ", 1)
    over = f"; median of {len(rounds)} rounds (min–max)" if len(rounds) > 1 else ""
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, {doc['jobs']:,} paragraphs, "
        f"mean {doc['mean_cost']} tokens{over}. Raw model"
        + (" (first round)" if len(rounds) > 1 else "")
        + ": "
        + ", ".join(shown)
        + ".",
        "",
    ]
    figures = e2e_figures(doc)
    labels = {"fixed": "fixed (32, 5 ms)"}
    rows = []
    for m in first["modes"]:
        mode, f = m["mode"], figures[m["mode"]]
        bold = mode == "ferry"
        rows.append(
            [
                labels.get(mode, mode),
                f["drain_jobs_per_s"].text(number(1), bold),
                f["drain_share_of_raw"].text(percent(), bold),
                f["drain_vs_none"].text(times(), bold),
                f["live_jobs_per_s"].text(number(1)),
                f["live_share_of_raw"].text(percent()),
                f["live_vs_none"].text(times()),
                f"{m['drain']['mean_batch_size']:.1f}",
                f"{m['drain']['efficiency']:.2f}",
            ]
        )
    header = ["policy", "drain jobs/s", "% of raw", "× none", "live jobs/s", "% of raw", "× none"]
    return lines + table([*header, "batch size", "efficiency"], "lrrrrrrrr", rows)


def render_e2e_targets(results: Results) -> list[str]:
    figures = e2e_figures(results["e2e"])
    ferry, raw = figures["ferry"], figures["raw"]
    rows = [
        [
            "drain ≥ 85 % of the raw ceiling",
            ferry["drain_share_of_raw"].text(percent()),
            verdict(ferry["drain_share_of_raw"].meets(0.85, at_least=True)),
        ],
        [
            "drain ≥ 3 × batching off (`none`)",
            ferry["drain_vs_none"].text(times()),
            verdict(ferry["drain_vs_none"].meets(3.0, at_least=True)),
        ],
        ["the model's own gain from batching (ceiling / batch 1)", raw["gain"].text(times()), "—"],
    ]
    return table(["target (ferry)", "value", "met"], "lrl", rows)


# --- the per-job path (api.json) ---------------------------------------------------------


def _stack_label(stack: Doc) -> str:
    database = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}[stack["database"]]
    count = stack["api_processes"]
    return f"{database}, {count} API process" + ("es" if count > 1 else "")


def render_api(results: Results) -> list[str]:
    doc = results["api"]
    stacks = [s for s in doc["stacks"] if not s.get("error")]
    rounds = doc["settings"]["rounds"]
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of {rounds} rounds "
        "(min–max):",
        "",
    ]

    def cells(get: Callable[[Doc], Mapping[str, float]], fmt: Fmt) -> list[str]:
        return [Figure.summary(get(s["summary"])).text(fmt) for s in stacks]

    rows = [
        ["bare endpoint, requests/s", *cells(lambda s: s["bare"]["requests_per_s"], number())],
        [
            "bare endpoint, CPU per request, ms",
            *cells(lambda s: s["bare"]["cpu_ms_per_job"]["bare"], number(2)),
        ],
        ["submit, requests/s", *cells(lambda s: s["submit"]["requests_per_s"], number())],
        ["get, requests/s", *cells(lambda s: s["get"]["requests_per_s"], number())],
        ["submit + long-poll, jobs/s", *cells(lambda s: s["longpoll"]["jobs_per_s"], number())],
        [
            "API CPU per submission, ms",
            *cells(lambda s: s["submit"]["cpu_ms_per_job"]["api"], number(2)),
        ],
        ["API CPU per GET, ms", *cells(lambda s: s["get"]["cpu_ms_per_job"]["api"], number(2))],
        [
            "API CPU per submitted and long-polled job, ms",
            *cells(lambda s: s["longpoll"]["cpu_ms_per_job"]["api"], number(2)),
        ],
        [
            "worker CPU per sim job (submit run), ms",
            *cells(lambda s: s["submit"]["cpu_ms_per_job"]["worker"], number(2)),
        ],
        [
            "database CPU per submission, ms",
            *cells(lambda s: s["submit"]["cpu_ms_per_job"]["postgres_all"], number(2)),
        ],
    ]
    return lines + table(["", *map(_stack_label, stacks)], "l" + "r" * len(stacks), rows)


def render_api_targets(results: Results) -> list[str]:
    doc = results["api"]
    rows = []
    for stack in doc["stacks"]:
        if stack.get("error") or stack["api_processes"] != 1:
            continue
        ratios = stack["ratios"]
        for key, what, target, at_least, fmt in (
            ("submit_per_bare", "submit, × the bare endpoint", 0.5, True, times()),
            ("longpoll_jobs_per_bare", "submit + long-poll, × bare", 0.3, True, times()),
            ("api_cpu_ms_per_submission", "API CPU per submission", 1.5, False, number(2, " ms")),
        ):
            figure = Figure.summary(ratios[key])
            rows.append(
                [
                    f"{what} ({_stack_label(stack)})",
                    figure.text(fmt),
                    fmt(target),
                    verdict(figure.meets(target, at_least)),
                ]
            )
    return table(["figure", "value", "target", "met"], "lrrl", rows)


# --- closed-loop clients (clients.json) -----------------------------------------------


def render_clients_raw(results: Results) -> list[str]:
    doc = results["clients"]
    raw = doc["raw"]
    sizes = list(next(iter(raw["by_threads"].values())))
    rows = []
    for threads, rates in raw["by_threads"].items():
        row = [threads]
        for size in sizes:
            best = int(threads) == raw["ceiling_threads"] and int(size) == raw["ceiling_batch"]
            row.append(f"**{rates[size]:.1f}** (the ceiling)" if best else f"{rates[size]:.1f}")
        rows.append(row)
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, load average "
        f"{doc['load_average']['at_start'][0]:.1f} at the start, "
        f"{doc['sample']['texts']:,} paragraphs of the corpus (mean "
        f"{doc['sample']['tokens_mean']} tokens). Raw model, texts/s:",
        "",
        *table(["torch threads", *(f"batch {s}" for s in sizes)], "l" + "r" * len(sizes), rows),
    ]
    if raw.get("again") is not None:
        lines += [
            "",
            f"(Timed again after the stacks, the ceiling's configuration gave {raw['again']:.1f}"
            f", {abs(raw['drift']):.1%} {'less' if raw['drift'] < 0 else 'more'}: the machine "
            "drifts by that much within a run.)".replace("%", " %", 1),
        ]
    return lines


def render_clients(results: Results) -> list[str]:
    doc = results["clients"]
    rows = []
    for stack in doc["stacks"]:
        if stack.get("error"):
            continue
        s = stack["summary"]
        best = stack["cpu_threads"] == doc.get("best_cpu_threads")

        def ms(value: float | None) -> str:
            # A round whose clients saw no job finish (a short smoke round on a busy
            # machine) has no latency; its file holds null.
            return "–" if value is None else f"{value / 1000:.2f} s"

        rows.append(
            [
                str(stack["cpu_threads"]),
                Figure.summary(s["jobs_per_s"]).text(number(1), best),
                Figure.summary(s["ratio"]).text(percent(1), best),
                f"{ms(s['job_p50_ms']['median'])} / {ms(s['job_p99_ms']['median'])}",
                f"{s['mean_batch_size']['median']:.1f}",
                f"{s['cpu_ms_per_job']['api']['median']:.2f} ms",
                f"{s['cpu_ms_per_job']['worker']['median']:.1f} ms",
            ]
        )
    header = ["`FERRY_CPU_THREADS`", "jobs/s", "% of the ceiling", "job p50 / p99", "batch"]
    return table([*header, "API CPU / job", "worker CPU / job"], "lrrrrrr", rows)


def render_clients_target(results: Results) -> list[str]:
    doc = results["clients"]
    best = doc.get("best_cpu_threads")
    ratio = doc["ratios"][str(best)]
    figure = Figure.summary(ratio)
    return [
        f"Against the target (80 % of the raw ceiling, `FERRY_CPU_THREADS={best}`): "
        f"{figure.text(percent(1))}, {verdict(figure.meets(0.8, at_least=True))}."
    ]


# --- peers side by side (peers.json) -----------------------------------------------------


PEERS = (
    ("raw", "raw model, no serving layer"),
    ("raw-arrival", "raw model, unsorted"),
    ("ray", "Ray Serve, `@serve.batch`"),
    ("celery", "Celery, a task per request"),
    ("ferry-longpoll", "Ferry, submit + long-poll"),
    ("ferry-wait", "Ferry, `POST /v1/jobs?wait=`"),
)
PEERS_HEADER = (
    "system", "what it batches", "requests/s", "% of the raw ceiling", "p50", "p99", "mean batch",
)  # fmt: skip


def counted(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def peers_batching(doc: Doc, name: str) -> str:
    ray, ceiling = doc["settings"]["ray"], doc["ceiling"]
    children = doc["settings"]["celery"]["concurrency"]
    return {
        "raw": f"texts sorted by length, batches of {ceiling['batch']}, "
        + counted(ceiling["threads"], "torch thread", "torch threads"),
        "raw-arrival": f"texts as they come, batches of {ray['max_batch_size']}, each padded "
        "to its longest",
        "ray": f"up to {ray['max_batch_size']} requests or "
        f"{1000 * ray['batch_wait_timeout_s']:g} ms, one replica",
        "celery": "none: one text a task, "
        + counted(children, "worker process", "worker processes"),
    }.get(name, f"its scheduler: what waits, grouped by cost, {ferry_batch_limit(doc)}")


def ferry_batch_limit(doc: Doc) -> str:
    """Ferry's largest batch as the run set it: a FERRY_BATCH_MAX_SIZE it was given, else
    the size each worker derives from its model's latency (the default)."""
    size = doc["settings"]["ferry"]["settings"].get("FERRY_BATCH_MAX_SIZE")
    if size is not None:
        return f"up to {size}"
    return "up to the size its worker derives from the model's latency (the default)"


def render_peers(results: Results) -> list[str]:
    doc = results["peers"]
    summary, settings = doc["summary"], doc["settings"]
    ms = number(0, " ms")
    rows = []
    for name, label in PEERS:
        found = summary.get(name)
        if found is None:
            continue
        if not found["repeats"]:
            rows.append([label, peers_batching(doc, name), "failed", "", "", "", ""])
            continue
        ferry = name.startswith("ferry")
        latency = "¹" if name.startswith("raw") else ""
        rows.append(
            [
                label,
                peers_batching(doc, name),
                Figure.summary(found["per_s"]).text(number(1), ferry),
                Figure.summary(found["ratio"]).text(percent(1), ferry),
                Figure.summary(found["p50_ms"]).text(ms) + latency,
                Figure.summary(found["p99_ms"]).text(ms) + latency,
                f"{found['mean_batch']['median']:.1f}",
            ]
        )
    errors = {n: s["errors"] for n, s in summary.items() if s.get("errors")}
    failed = {n: s["failed"] for n, s in summary.items() if s.get("failed")}
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, load average "
        f"{doc['machine']['load_average_at_start'][0]:.1f} at the start; "
        f"{doc['sample']['texts']:,} paragraphs of the corpus (mean {doc['sample']['tokens_mean']}"
        f" tokens); {settings['clients']} closed-loop clients, {settings['warmup_s']:g} s of "
        f"warm-up then {settings['duration_s']:g} s measured, "
        f"{counted(settings['repeats'], 'repeat', 'repeats')}; each system's model with "
        f"{counted(settings['threads'], 'torch thread', 'torch threads')}; Ray "
        f"{settings['ray']['version']}, "
        f"Celery {settings['celery']['version']}:",
        "",
        *table(PEERS_HEADER, "llrrrrr", rows),
        "",
        "¹ The raw model's p50 and p99 are one batch's compute, not a request's latency.",
    ]
    if errors or failed:
        lines += [
            "",
            "Failed calls within the measured windows: "
            + ", ".join(f"{n} {c:,}" for n, c in errors.items())
            + (f"; repeats that failed: {failed}" if failed else ""),
        ]
    return lines


def headline_peers(doc: Doc) -> str:
    summary = doc["summary"]

    def measured(name: str) -> bool:
        return bool(summary.get(name) and summary[name]["repeats"])

    def share(name: str, bold: bool = False) -> str:
        if not measured(name):
            return "not measured"
        return Figure.summary(summary[name]["ratio"]).text(percent(), bold)

    def p99(name: str) -> str:
        return f"{summary[name]['p99_ms']['median'] / 1000:.1f} s" if measured(name) else "-"

    unsorted = (
        ", as much as the model alone on unsorted batches "
        f"({percent()(summary['raw-arrival']['ratio']['median'])})"
        if measured("raw-arrival")
        else ""
    )
    return (
        f"- **Peers, side by side.** The same {doc['settings']['clients']} closed-loop clients,"
        " corpus and all-MiniLM-L6-v2 on 2 shared CPU cores: Ferry serves "
        f"{share('ferry-longpoll', True)} of the model's raw ceiling with submit + long-poll and "
        f"{share('ferry-wait', True)} in one round trip (p99 {p99('ferry-longpoll')} and "
        f"{p99('ferry-wait')}); a Celery task per request {share('celery')} (p99 "
        f"{p99('celery')}); Ray Serve's `@serve.batch` {share('ray')} (p99 {p99('ray')})"
        f"{unsorted}."
    )


# --- soak (soak.json) --------------------------------------------------------------------


SOAK_ORDER = ("api-", "worker-", "celery-", "flower", "redis")


def soak_names(summary: Mapping[str, Any]) -> list[str]:
    """The soak's processes in SOAK_ORDER, each kind's by name."""
    rank = {name: next((i for i, p in enumerate(SOAK_ORDER) if name.startswith(p)), 99)
            for name in summary}  # fmt: skip
    return sorted(summary, key=lambda name: (rank[name], name))


def render_soak(results: Results) -> list[str]:
    doc = results["soak"]
    settings = doc["settings"]
    details = doc["details"]
    kills, every, victims = doc["kills"], settings["kill_every_s"], doc["victims"]

    def killed(kind: str, what: str) -> str:
        return f"{what} {counted(len(kills[kind]), 'time', 'times')} (every {every[kind]:g} s)"

    statuses = ", ".join(f"{n:,} {s}" for s, n in details["statuses"].items())
    retried = sum(details["retried"].values())
    rows = []
    for name in soak_names(doc["memory"]["summary"]):
        m = doc["memory"]["summary"][name]
        label = f"{name} (killed)" if name in victims.values() or name == "redis" else name
        longest = (
            f"{m['longest_life_min']:g} min: {m['longest_life_start_mib']:.1f} → "
            f"{m['longest_life_end_mib']:.1f}"
            if m["lives"] > 1
            else "the whole run"
        )
        rows.append([label, str(m["lives"]), f"{m['start_mib']:.1f} → {m['end_mib']:.1f}",
                     f"{m['peak_mib']:.1f}", longest])  # fmt: skip
    problems = f" Problems: {', '.join(doc['problems'])}." if doc["problems"] else ""
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}: {settings['minutes']:g} minutes "
        f"at {settings['rate_per_s']:g} jobs/s across the lanes, PostgreSQL, with SIGKILL for "
        f"{killed('worker', 'a sim worker')}, {killed('api', 'an API process')} and "
        f"{killed('redis', 'Redis')}, started again on its data "
        f"{settings['redis_down_s']:g} s later. **{doc['submitted']:,} jobs accepted, "
        f"{doc['completed']:,} made terminal ({statuses}): {doc['lost']:,} lost, "
        f"{doc['written_twice']:,} written twice, {doc['run_twice']:,} run twice**, by the "
        f"database's transition log and the sim's record of its computations; "
        f"{doc['after_crash']:,} computed again after a kill, each in the last batches of a "
        f"killed worker. The clients retried {retried:,} requests (same Idempotency-Key), "
        f"{details['replayed_after_retry']:,} answered with the job a cut-off request had made; "
        f"the reconciler enqueued {details['reenqueued']:,} jobs again. The done channel, a "
        f"cross-check only, announced {details['announced_twice']:,} jobs twice and missed "
        f"{details['unannounced_terminal']:,}.{problems}",
        "",
        "Resident memory in MiB, each process with what it forked: from the first sample "
        f"{doc['memory']['settled_after_s']:g} s in to the last, the peak, and a restarted "
        f"process's longest life (from {doc['memory']['settled_after_s']:g} s into it):",
        "",
        *table(["process", "lives", "RSS MiB", "peak", "longest life"], "lrrrl", rows),
    ]


# --- Redis failover (sentinel.json) ---------------------------------------------------------


def render_sentinel(results: Results) -> list[str]:
    doc = results["sentinel"]
    settings = doc["settings"]
    runs = runs_of(doc)
    recovered = doc["recovered_s"]
    rows = [
        [
            str(number),
            f"{run['recovered_s']:.1f}" if run["recovered_s"] is not None else "never",
            f"{run['accepted']:,} of {run['sent']:,}",
            f"{run['refused']:,}",
            f"{run['requeued']:,}",
            f"{run['lost']:,}",
            f"{run['run_twice']:,}",
        ]
        for number, run in enumerate(runs, 1)
    ]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}: {settings['rate_per_s']:g} "
        f"jobs/s for {settings['load_s']:g} s, the primary killed at "
        f"{settings['kill_at_s']:g} s (the sentinels call it down after "
        f"{settings['down_after_ms']:,} ms). Jobs flowed again **{recovered['median']:.1f} s** "
        f"after the kill (median of {len(runs)}; {recovered['min']:.1f}–{recovered['max']:.1f}); "
        f"**{doc['lost']:,} lost, {doc['run_twice']:,} run twice**.",
        "",
        *table(
            [
                "round",
                "flowing again (s)",
                "accepted",
                "refused",
                "enqueued again",
                "lost",
                "run twice",
            ],
            "rrrrrrr",
            rows,
        ),
    ]


# --- Redis Cluster (cluster.json) ------------------------------------------------------------


def render_cluster(results: Results) -> list[str]:
    doc = results["cluster"]
    settings = doc["settings"]
    runs = runs_of(doc)
    names = {"one": "one Redis", "cluster": f"a cluster of {settings['primaries']} primaries"}
    rows = [
        [
            names[name],
            Figure.summary(doc[name]["cpu_us_per_job"]).text(number(1)),
            Figure.summary(doc[name]["busiest_share"]).text(percent()),
            Figure.summary(doc[name]["saturates_at"]).text(number(), bold=name == "cluster"),
        ]
        for name in ("one", "cluster")
    ]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}: {settings['jobs']:,} jobs of "
        f"{settings['models']} models from {settings['tenants']} keys, enqueued in groups of "
        f"{settings['group']} and drained in batches of up to {settings['batch']}, on each "
        f"target in turn, {len(runs)} rounds (median and range). The cluster carries "
        f"**{Figure.summary(doc['ratio']).text(times())}** the jobs per second of one Redis.",
        "",
        *table(
            [
                "Redis",
                "CPU per job (µs, all nodes)",
                "busiest node's share",
                "saturates at (jobs/s)",
            ],
            "lrrr",
            rows,
        ),
    ]


# --- the capacity model (capacity.json) ------------------------------------------------------

CAPACITY_ROWS = (
    ("Redis", "commands per job", "redis_commands", 1),
    ("Redis", "bytes in and out per job", "redis_bytes", 0),
    ("Redis", "CPU per job (µs)", "redis_cpu_us", 1),
    ("PostgreSQL", "transactions per job", "db_transactions", 2),
    ("PostgreSQL", "rows written per job", "db_rows_written", 2),
    ("PostgreSQL", "statements per submission", "db_statements_per_submission", 2),
    ("PostgreSQL", "statements per batch", "db_statements_per_batch", 1),
    ("PostgreSQL", "CPU per job, its backends (µs)", "postgres_cpu_us", 0),
    ("API", "CPU per submission (µs)", "api_cpu_us_per_submission", 0),
    ("API", "CPU per long-poll (µs)", "api_cpu_us_per_long_poll", 0),
    ("worker", "CPU per job outside the model (µs)", "worker_cpu_us_per_job", 0),
    ("worker", "jobs per batch", "jobs_per_batch", 1),
)
# What a deployment of 100 GPUs asks of the shared parts, at these jobs/s per GPU.
GPUS = 100
PER_GPU = (10, 100, 1000)


def _spread_text(found: Doc, digits: int) -> str:
    median, low, high = (f"{found[k]:,.{digits}f}" for k in ("median", "min", "max"))
    return median if low == high else f"{median} ({low}–{high})"


def render_capacity(results: Results) -> list[str]:
    doc = results["capacity"]
    settings = doc["settings"]
    costs, walls = doc["per_job"], doc["walls_jobs_per_s"]
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}: {settings['jobs']:,} sim jobs "
        f"from {settings['clients']} clients, batches of up to {settings['batch_max_size']}, "
        f"PostgreSQL; median of {settings['rounds']} rounds (range).",
        "",
        *table(
            ["part", "cost", "measured"],
            "llr",
            [
                [part, what, _spread_text(costs[key], digits)]
                for part, what, key, digits in CAPACITY_ROWS
            ],
        ),
        "",
        f"The enqueue alone, {settings['enqueue_messages']:,} jobs from "
        f"{settings['enqueue_tenants']} API keys in pipelines of one group commit's size: "
        "Redis's CPU (µs) and commands per job, a script call per job (`enqueue`) against "
        "one per tenant's stream in the group (`enqueue_all`, what Ferry does):",
        "",
        *table(
            ["jobs per group", "enqueue: µs", "commands", "enqueue_all: µs", "commands"],
            "rrrrr",
            [
                [
                    size,
                    _spread_text(doc["enqueue"][size]["enqueue"]["redis_cpu_us"], 1),
                    _spread_text(doc["enqueue"][size]["enqueue"]["redis_commands"], 2),
                    _spread_text(doc["enqueue"][size]["enqueue_all"]["redis_cpu_us"], 1),
                    _spread_text(doc["enqueue"][size]["enqueue_all"]["redis_commands"], 2),
                ]
                for size in doc["enqueue"]
            ],
        ),
        "",
        "Where each part saturates (jobs/s; one core each: Redis runs its commands on one "
        "thread, PostgreSQL's figure is per core of its server, the API's per process), and "
        f"what {GPUS} GPUs finishing R jobs/s each ask of them:",
        "",
    ]
    redis_wall = walls["redis"]["median"]
    postgres_core = walls["postgres_one_core"]["median"]
    api_process = walls["api_process"]["median"]
    rows = [
        ["saturates at"]
        + [
            _spread_text(walls[name], 0)
            for name in ("redis", "postgres_one_core", "api_process", "worker_overhead")
        ]
    ]
    for rate in PER_GPU:
        total = GPUS * rate
        rows.append(
            [
                f"{GPUS} GPUs × {rate:,} jobs/s",
                f"{total / redis_wall:.0%} of its core",
                f"{total / postgres_core:,.1f} cores",
                f"{math.ceil(total / api_process):,} processes",
                f"{rate / walls['worker_overhead']['median']:.1%} of a core per worker",
            ]
        )
    return [
        *lines,
        *table(["", "Redis", "PostgreSQL", "API", "worker (outside the model)"], "lrrrr", rows),
    ]


# --- mutation testing (mutation.json) ---------------------------------------------------------


def render_mutation(results: Results) -> list[str]:
    doc = results["mutation"]
    targets = doc["targets"]
    seconds = "; ".join(f"{name} {target['seconds']:.0f} s" for name, target in targets.items())
    rows = []
    for name, target in targets.items():
        files = target["files"]
        for path, found in files.items():
            label = f"`{path}`"
            if name == "recorder":
                label += " (`finish`, `_batched_writes`)"
            rows.append((label, found))
        if len(files) > 1:
            rows.append((f"**{target['mutated'][0]}**", target["total"]))
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)} ({seconds}):",
        "",
        *table(
            ["file", "mutants", "killed", "timeout", "survived", "score"],
            "lrrrrr",
            [
                [
                    label,
                    f"{found['mutants']:,}",
                    f"{found['killed']:,}",
                    f"{found['timeout']:,}",
                    f"{found['survived']:,}",
                    f"{100 * found['score']:.1f} %",
                ]
                for label, found in rows
            ],
        ),
    ]


# --- backfills (backfill.json) -------------------------------------------------------------


def render_backfill_latency(results: Results) -> list[str]:
    doc = results["backfill"]
    runs = runs_of(doc)
    first = runs[0]
    over = f"; median of {len(runs)} runs (min–max)" if len(runs) > 1 else ""
    wall = Figure.of(r["wall_s"] for r in runs).text(number())
    ride = first["settings"].get("FERRY_BULK_RIDE_FACTOR", "1.25")
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, load average "
        f"{first['load_average']['start'][0]:.1f} at the start, {wall} s of wall time a run, "
        f"`FERRY_BULK_RIDE_FACTOR={ride}`"
        + (" (the default)" if "FERRY_BULK_RIDE_FACTOR" not in first["settings"] else "")
        + f"{over}. A full batch of the backfill's mean cost "
        f"({first['backfill_mean_cost']:.2f}) takes {first['full_batch_ms']:.1f} ms: the raw "
        f"model does {first['raw_lines_per_s']:.1f} lines/s at full batches. Interactive "
        f"latency, ms (urgent has {first['idle']['lanes']['urgent']['jobs']} jobs and vip "
        f"{first['idle']['lanes']['vip']['jobs']}, so their p99 is their maximum):",
        "",
    ]
    rows = []
    for lane in ("urgent", "vip", "normal", "all"):

        def at(phase: str, key: str, bold: bool = False, lane: str = lane) -> str:
            values = [
                (r[phase]["overall"] if lane == "all" else r[phase]["lanes"][lane])[key]
                for r in runs
            ]
            # A lane no job of a phase went to (a short run) has no latency to show.
            if any(value is None for value in values):
                return "–"
            return Figure.of(values).text(number(1), bold)

        bold = lane == "all"
        rows.append(
            [
                "**all**" if bold else lane,
                at("idle", "p50_ms"),
                at("idle", "p99_ms", bold),
                at("busy", "p50_ms"),
                at("busy", "p99_ms", bold),
            ]
        )
    lines += table(["lane", "idle p50", "idle p99", "busy p50", "busy p99"], "lrrrr", rows)

    def overall(phase: str, key: str) -> str:
        return Figure.of(r[phase]["overall"][key] for r in runs).text(number(1))

    lines += [
        "",
        f"Interactive jobs ran in batches of {overall('idle', 'mean_batch_size')} jobs "
        f"({overall('idle', 'mean_inference_ms')} ms) on average when idle, and "
        f"{overall('busy', 'mean_batch_size')} jobs ({overall('busy', 'mean_inference_ms')} ms)"
        " beside the backfill. The backfill:",
        "",
    ]
    return lines


def render_backfill_throughput(results: Results) -> list[str]:
    runs = runs_of(results["backfill"])
    first = runs[0]

    def of(window: str, key: str, fmt: Fmt) -> str:
        return Figure.of(r[window][key] if key else r[window] for r in runs).text(fmt)

    size = first["settings"]["FERRY_BATCH_MAX_SIZE"]
    rows = [
        [
            "raw model, full batches (formula)",
            f"{first['raw_lines_per_s']:.1f}",
            "100 %",
            f"{size} × {first['full_batch_ms']:.1f} ms",
        ]
    ]
    for window, share, what in (
        ("backfill_alone", "alone_share_of_raw", "backfill alone"),
        ("backfill_busy", "busy_share_of_raw", f"backfill beside {first['rate_per_s']:g} "
         "interactive jobs/s"),
    ):  # fmt: skip
        rows.append(
            [
                what,
                of(window, "lines_per_s", number(1)),
                of(share, "", percent()),
                f"{of(window, 'avg_batch_size', number(1))} × "
                f"{of(window, 'avg_batch_ms', number(1))} ms",
            ]
        )
    return table(["", "lines/s", "of raw", "batches"], "lrrl", rows)


def render_backfill_target(results: Results) -> list[str]:
    runs = runs_of(results["backfill"])

    def of(key: str) -> Figure:
        return Figure.of(r[key] for r in runs)

    full = of("target_full_batch_ms")
    mean = of("target_ms")
    full_met = all(r["target_met_full_batch"] for r in runs)
    mean_met = all(r["target_met"] for r in runs)
    rows = [
        ["`p99_idle_ms`", of("p99_idle_ms").text(number(1))],
        ["`p99_busy_ms`", of("p99_busy_ms").text(number(1), bold=True)],
        [
            f"idle p99 + a full bulk batch ({runs[0]['full_batch_ms']:.1f} ms): the batch an"
            " interactive job may find running",
            f"{full.text(number(1))}: **{'met' if full_met else 'not met'}**",
        ],
        [
            f"idle p99 + the mean batch of the busy window ({of('one_batch_ms').text(number(1))}"
            " ms)",
            f"{mean.text(number(1))}: {'met' if mean_met else 'not met'}",
        ],
    ]
    return table(["figure", "ms"], "lr", rows)


# --- fair share (fairness.json) ------------------------------------------------------------


def render_fairness(results: Results) -> list[str]:
    doc = results["fairness"]
    runs = runs_of(doc)
    over = f"; median of {len(runs)} runs (min–max)" if len(runs) > 1 else ""
    lines = [f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, pipelined worker{over}:", ""]
    rows = []
    for index, phase in enumerate(runs[0]["phases"]):

        def of(key: str, index: int = index) -> Figure:
            return Figure.of(r["phases"][index][key] for r in runs)

        own = phase["name"] == "flood, own key"
        ahead_p99, ahead_max = of("batches_ahead_p99"), of("batches_ahead_max")
        ahead = f"{ahead_p99.high:.0f} / {ahead_max.high:.0f}"
        batch = (
            of("batch_p99_ms").text(number())
            if all(r["phases"][index]["batch_p99_ms"] is not None for r in runs)
            else "-"
        )
        rows.append(
            [
                phase["name"],
                f"{of('jobs').median:.0f}",
                of("p50_ms").text(number()),
                of("p99_ms").text(number(), own),
                of("max_ms").text(number()),
                f"**{ahead}**" if own else ahead,
                batch,
            ]
        )
    header = ["phase", "steady jobs", "p50 ms", "p99 ms", "max ms", "batches ahead, p99 / max"]
    lines += table([*header, "batch p99 ms"], "lrrrrrr", rows)
    if len(runs) > 1:
        lines += ["", "(Batches ahead: the most of any run.)"]
    return lines


# --- backends (backends.json) ------------------------------------------------------------


def render_backends(results: Results) -> list[str]:
    doc = results["backends"]
    versions = doc["versions"]
    settings = doc["settings"]
    shares = [
        share
        for backend in doc["backends"]
        for order in backend["orders"].values()
        for share in order["cpu_share"]
    ]
    lines = [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; PyTorch "
        f"{versions['torch'].split('+')[0]} ({settings['torch_threads']} threads), ONNX Runtime "
        f"{versions['onnxruntime']}, transformers {versions['transformers']}. The process had "
        f"{100 * min(shares):.0f} to {100 * max(shares):.0f} % of the cores in every timed run. "
        + "; ".join(
            f"{order}: {o['texts']} texts, {o['mean_tokens']} tokens a text, "
            f"{o['mean_padded_tokens']} once padded"
            for order, o in settings["orders"].items()
        )
        + ".",
        "",
    ]
    rows = []
    for order in ("sorted", "arrival"):
        ranked = [b for b in doc["backends"] if not b.get("error") and b["backend"] != "eager"]
        best = max(ranked, key=lambda b: b["orders"][order]["ratio_to_eager"])["backend"]
        for backend in doc["backends"]:
            if backend.get("error"):
                continue
            measured = backend["orders"][order]
            bold = backend["backend"] == best
            runs = ", ".join(f"{r:.2f}" for r in measured["runs"])
            ratio = (
                "1.00×"
                if backend["backend"] == "eager"
                else Figure.of(measured["ratios_to_eager"]).text(times(), bold)
            )
            cosine = (
                "—" if backend["backend"] == "eager" else f"{measured['min_cosine_to_eager']:.7f}"
            )
            rows.append(
                [
                    backend["backend"],
                    order,
                    f"**{measured['median']:.2f}**" if bold else f"{measured['median']:.2f}",
                    runs,
                    f"{measured['spread']:.1%}".replace("%", " %"),
                    ratio,
                    cosine,
                ]
            )
    header = ["backend", "order", "median embeddings/s", "runs", "spread", "× eager"]
    lines += table([*header, "min cosine to eager"], "llrlrrr", rows)
    setup = ", ".join(
        f"{b['backend']} {b['setup_s']:.1f} s"
        for b in doc["backends"]
        if not b.get("error") and b["backend"] != "onnx, default threads"
    )
    lines += [
        "",
        "(Spread: (max − min) / median; × eager: the median of the per-repeat ratios, and "
        f"their range. Start-up, from load to warmed up: {setup}.)",
    ]
    return lines


# --- the pipelined worker (pipeline.json) ------------------------------------------------------


def pipeline_figures(doc: Doc) -> dict[tuple[str, str], dict[str, Figure]]:
    """Per (database, mode): jobs/s, idle, batch, and jobs/s over the same round's plain."""
    modes = doc["modes"]
    plain = {
        (m["database"], m.get("round", 1)): m["jobs_per_s"] for m in modes if m["mode"] == "plain"
    }
    found: dict[tuple[str, str], dict[str, list[float]]] = {}
    for m in modes:
        values = found.setdefault((m["database"], m["mode"]), {})
        values.setdefault("jobs_per_s", []).append(m["jobs_per_s"])
        values.setdefault("device_idle", []).append(m["device_idle"])
        values.setdefault("mean_batch_size", []).append(m["mean_batch_size"])
        values.setdefault("ceiling", []).append(m["jobs_per_s"] / (m["jobs"] / m["compute_s"]))
        values.setdefault("vs_plain", []).append(
            m["jobs_per_s"] / plain[(m["database"], m.get("round", 1))]
        )
    return {key: {k: Figure.of(v) for k, v in values.items()} for key, values in found.items()}


def render_pipeline(results: Results) -> list[str]:
    doc = results["pipeline"]
    figures = pipeline_figures(doc)
    rounds = max(m.get("round", 1) for m in doc["modes"])
    over = f"; median of {rounds} rounds (min–max)" if rounds > 1 else ""
    lines = [f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}{over}:", ""]
    names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
    rows = []
    for (database, mode), f in figures.items():
        best = mode == "three-stage"
        rows.append(
            [
                names[database],
                mode,
                f["jobs_per_s"].text(number()),
                f["vs_plain"].text(times(), best),
                f["ceiling"].text(percent()),
                f["device_idle"].text(percent(1), best),
                f"{f['mean_batch_size'].median:.1f}",
            ]
        )
    header = ["database", "worker", "jobs/s", "× plain", "of the device's ceiling"]
    return lines + table([*header, "device idle", "batch"], "llrrrrr", rows)


# --- the result write (recording.json) -------------------------------------------------------


def render_recording(results: Results) -> list[str]:
    doc = results["recording"]
    settings = doc["settings"]
    names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
    outputs = {"small": "small", "embedding": "384 floats"}
    rows = [
        [
            names[row["database"]],
            outputs[row["outputs"]],
            f"{row['per_job_ms']['median']:.1f} ms",
            f"{row['batched_ms']['median']:.1f} ms",
            Figure.summary(row["ratio"]).text(times()),
        ]
        for row in doc["rows"]
    ]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of "
        f"{settings['batches']} batches of {settings['size']} (the ratio: batch by batch, "
        "median and range):",
        "",
        *table(
            ["database", "outputs", "one statement per job", "one per batch", "ratio"],
            "llrrr",
            rows,
        ),
    ]


# --- text generation (generation.json) -------------------------------------------------------

GENERATION_SYSTEMS = {"ferry": "Ferry", "static": "static generate()", "single": "one at a time"}
GENERATION_MODES = {"offline": "all at 0", "poisson": "Poisson"}


def generation_setup(doc: Doc) -> str:
    s, w = doc["settings"], doc["workload"]
    m, cal = s["model"], doc["calibration"]
    grid = ", ".join(f"{b}: {v:,.0f}" for b, v in cal["static_tokens_per_s_by_size"].items())
    shares = [
        run["cpu_share"]
        for r in doc["rounds"]
        for m in GENERATION_MODES
        if m in r
        for run in r[m].values()
    ]
    poisson = (
        f" Poisson at {cal['poisson_rate_per_s']:.2f} requests/s "
        f"({percent()(s['poisson_load'])} of Ferry's measured capacity)."
        if "poisson" in doc
        else ""
    )
    return (
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of "
        f"{counted(len(doc['rounds']), 'round', 'rounds')} (min–max). A {m['arch']}-shaped "
        f"model of {m['layers']} layers, hidden {m['hidden']} ({m['parameters'] / 1e6:.1f} M "
        f"parameters, random weights), {s['precision']} on `{s['device']}`, "
        f"{counted(s['threads'], 'torch thread', 'torch threads')}; the process had "
        f"{percent()(min(shares))} to {percent()(max(shares))} of a core in the timed runs. "
        f"{s['requests']} requests: prompts {w['prompt_tokens']['p50']:g} tokens at the median, "
        f"{w['prompt_tokens']['max']} at most; outputs {w['output_tokens']['p50']:g} at the "
        f"median, {w['output_tokens']['max']} at most ({w['output_tokens']['total']:,} in all, "
        f"EOS ignored).{poisson} Static batches of "
        f"{cal['static_batch']}, the best offline of the grid (output tokens/s: {grid}). "
        f"Ferry: max_running {s['ferry']['max_running']}, step_tokens "
        f"{s['ferry']['step_tokens']}, prefill_chunk_tokens {s['ferry']['prefill_chunk_tokens']}; "
        f"its KV pool's peak {doc['peak_kv_blocks']:,} of {s['ferry']['kv_blocks']:,} blocks."
    )


def generation_figures(doc: Doc) -> list[str]:
    """The setup, the table of each arrival mode the file measured, and the ratios."""
    ms = number(0, " ms")
    modes = {mode: arrivals for mode, arrivals in GENERATION_MODES.items() if mode in doc}
    rows = []
    for mode, arrivals in modes.items():
        for system, name in GENERATION_SYSTEMS.items():
            f = {k: Figure.summary(v) for k, v in doc[mode][system].items()}
            rows.append(
                [arrivals, name, f["tokens_per_s"].text(number(), system == "ferry")]
                + [f[k].text(ms) for k in ("ttft_p50_ms", "ttft_p99_ms")]
                + [f[k].text(number(1, " ms")) for k in ("tpot_p50_ms", "tpot_p99_ms")]
            )
    header = ["arrivals", "system", "output tokens/s", "TTFT p50", "TTFT p99", "TPOT p50"]
    lines = [generation_setup(doc), "", *table([*header, "TPOT p99"], "llrrrrr", rows), ""]

    def ratio(mode: str, system: str) -> str:
        return Figure.summary(doc[mode]["ratios"][f"vs_{system}"]).text(times())

    ratios = "; ".join(
        f"{arrivals}: {ratio(mode, 'static')} static, {ratio(mode, 'single')} one at a time"
        for mode, arrivals in modes.items()
    )
    return [*lines, f"Ferry's output tokens/s over the others', round by round: {ratios}."]


def render_generation(results: Results) -> list[str]:
    return generation_figures(results["generation"])


def render_generation_gpu(results: Results) -> list[str]:
    doc = results["generation_gpu"]
    return [*generation_figures(doc), "", *generation_profile(doc)]


def render_generation_targets(results: Results) -> list[str]:
    doc = results["generation"]
    rows = []
    for system, target in doc["targets"].items():
        ratio = Figure.summary(target["ratio"])
        at_least = target["tokens_per_s_ratio_at_least"]
        rows.append(
            [
                f"tokens/s ≥ {at_least:g}× {GENERATION_SYSTEMS[system]}, all at 0",
                ratio.text(times(), True),
                "yes" if target["ttft_p99_same_or_better"] else "no",
                verdict(target["met"]),
            ]
        )
    header = ["target", "Ferry's ratio", "p99 TTFT same or better, every round, both arrivals"]
    lines = table([*header, "verdict"], "lrll", rows)
    found = doc.get("ceiling")
    if found and found.get("vs_single"):
        best = Figure.summary(found["vs_single"]).text(times(), True)
        lines += [
            "",
            f"What any batching could reach on this device: the model's own forward costs "
            f"{found['fixed_ms']:g} ms a call plus {found['per_token_ms']:g} ms a token "
            f"(one sequence of 64 and of 256 tokens), so the offline workload's "
            f"{found['tokens']:,} tokens take at least {found['floor_s']:g} s, and one at a "
            f"time's spans are {best} that floor: the most a scheduler that wastes nothing "
            f"could gain over it here.",
        ]
    return lines


def render_generation_chunked(results: Results) -> list[str]:
    doc = results["generation"]
    load = doc["workload"]["chunked"]
    ms = number(1, " ms")
    rows = [
        [
            "0 (whole prompts)" if chunk == "0" else chunk,
            *(
                Figure.summary(found[k]).text(ms)
                for k in ("decode_tpot_p99_ms", "decode_gap_p99_ms", "decode_gap_max_ms")
            ),
            Figure.summary(found["long_ttft_p50_ms"]).text(number(0, " ms")),
        ]
        for chunk, found in doc["chunked"].items()
    ]
    return [
        f"{load['decoders']} requests of {load['decoder_prompt']} prompt tokens decode "
        f"{load['decoder_tokens']} tokens each; {load['long_prompts']} prompts of "
        f"{load['long_prompt']} tokens arrive among them, one every {load['every_s']:g} s "
        f"(median of {counted(len(doc['rounds']), 'round', 'rounds')}, min–max):",
        "",
        *table(
            ["prefill_chunk_tokens", "decodes' TPOT p99", "decodes' token gap p99", "gap max",
             "long prompts' TTFT p50"],
            "lrrrr",
            rows,
        ),
    ]  # fmt: skip


def render_generation_profile(results: Results) -> list[str]:
    return generation_profile(results["generation"])


def generation_profile(doc: Doc) -> list[str]:
    found = doc["profile"]
    names = {
        "scheduler": "scheduler (schedule, update_from_output)",
        "runtime_outside_forward": "runtime outside the forward (tables, tensors, sampling, text)",
        "forward_outside_attention": "the library's layers (embeddings, norms, MLPs, head)",
        "attention_outside_sdpa": "paged attention outside SDPA (KV writes, gathers, its loop)",
        "sdpa": "SDPA, once per sequence per layer",
    }
    per_step = found["per_step_ms"]
    rows = [
        [name, f"{per_step[key]:.2f} ms", percent(1)(found["share_of_step"][key])]
        for key, name in names.items()
    ]
    return [
        f"One offline Ferry run, {found['steps']:,} steps of {per_step['step']:.1f} ms on "
        f"average, {found['tokens_per_step_mean']:.1f} tokens and "
        f"{found['sequences_per_step_mean']:.1f} sequences a step; "
        f"{found['sdpa_calls_per_step']:.0f} SDPA calls a step at "
        f"{found['us_per_sdpa_call']:.0f} µs each; Ferry's attention, all told, "
        f"{found['us_per_attention_call_per_sequence']:.0f} µs per sequence per layer:",
        "",
        *table(["part of a step", "a step", "share"], "lrr", rows),
    ]


def render_generation_stack(results: Results) -> list[str]:
    doc = results["generation_stack"]
    s, w = doc["settings"], doc["workload"]
    m, limits = s["model"], s["limits"]
    names = {"in_process": "the engine in one process", "stack": "ferry up, over HTTP, streamed"}
    rows = []
    for system, name in names.items():
        f = {k: Figure.summary(v) for k, v in doc[system].items()}
        rows.append(
            [name, f["tokens_per_s"].text(number(), system == "stack")]
            + [f[k].text(number(0, " ms")) for k in ("ttft_p50_ms", "ttft_p99_ms")]
            + [f[k].text(number(1, " ms")) for k in ("tpot_p50_ms", "tpot_p99_ms")]
        )
    share = Figure.summary(doc["stack_share"]).text(percent())
    added = Figure.summary(doc["ttft_p50_added_ms"]).text(number(0, " ms"))
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of "
        f"{counted(len(doc['rounds']), 'round', 'rounds')} (min–max), the two interleaved. A "
        f"{m['arch']}-shaped model of {m['layers']} layers, hidden {m['hidden']} (random "
        f"weights), {s['precision']} on `{s['device']}`, "
        f"{counted(s['threads'], 'torch thread', 'torch threads')} both ways; max_running "
        f"{limits['max_running']}, step_tokens {limits['step_tokens']}, prefill_chunk_tokens "
        f"{limits['prefill_chunk_tokens']}. {s['requests']} requests posted at once: prompts "
        f"{w['prompt_tokens']['p50']:g} tokens at the median, {w['prompt_tokens']['max']} at "
        f"most; outputs {w['output_tokens']['p50']:g} at the median, "
        f"{w['output_tokens']['max']} at most ({w['output_tokens']['total']:,} in all, no EOS). "
        "Through the stack each time is the client's: from its POST to each token event it "
        "read.",
        "",
        *table(["system", "output tokens/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"],
               "lrrrrr", rows),
        "",
        f"The stack's output tokens/s, round by round, are {share} of the engine's in one "
        f"process; its median time to first token is {added} longer.",
    ]  # fmt: skip


def _nan_for_none(value: Any) -> Any:
    """A results file's figures with NaN where it wrote null (a figure of nothing measured,
    as a smoke run on a busy machine may leave)."""
    if value is None:
        return float("nan")
    if isinstance(value, dict):
        return {k: _nan_for_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_for_none(v) for v in value]
    return value


def render_generation_promises(results: Results) -> list[str]:
    raw = results["generation_promises"]
    about = ("date", "command", "via_make", "smoke", "git", "machine", "settings")
    doc = {k: v if k in about else _nan_for_none(v) for k, v in raw.items()}
    s, m, shape = doc["settings"], doc["settings"]["model"], doc["settings"]["shape"]
    ms = number(0, " ms")

    def fig(name: str, fmt: Fmt, *keys: str, bold: bool = False) -> str:
        found: Any = doc[name]
        for key in keys:
            found = found[key]
        return Figure.summary(found).text(fmt, bold)

    def steps(way: str) -> str:
        per_round = [r["preemption"]["urgent_ttft_steps"][way]["p99"] for r in doc["rounds"]]
        return Figure.of(per_round if len(set(per_round)) > 1 else per_round[:1]).text(number())

    gain = Figure.summary(doc["urgent_ttft_gain"])
    ratio = Figure.summary(doc["light_ttft_p99_ratio"])
    share = Figure.summary(doc["heavy_kv_share"])
    cost = Figure.summary(doc["checkpoint_cost"])
    spaced = Figure.summary(doc["checkpoint_cost_every_50_ms"])
    preempted = doc["preempted_jobs"]
    rows = [
        [
            f"urgent TTFT p99, the running batch full of bulk generations "
            f"({shape['bulk_running']} of {shape['bulk']}, {shape['bulk_tokens']} tokens each)",
            f"{fig('urgent_ttft_p99_ms', ms, 'preemption', bold=True)} with preemption, "
            f"{fig('urgent_ttft_p99_ms', ms, 'no_preemption')} without: "
            f"{gain.text(times(1))} sooner (in steps: {steps('preemption')} and "
            f"{steps('no_preemption')})",
            "within a few steps",
        ],
        [
            "the bulk jobs it preempted",
            f"{preempted} preempted in all, each ended {fig('preempted_delay_p50_ms', ms)} "
            f"later at the median; {doc['preempted_outputs_equal']} of {preempted} with the "
            f"tokens they make unpreempted, {doc['restarted_from_zero']} restarted from zero"
            if preempted
            else "none was preempted",
            "same tokens, 0 restarted",
        ],
        [
            f"a light key's TTFT p99 beside a flood at {shape['flood_factor']:g}× its rate "
            f"({shape['flood_tokens']}-token generations)",
            f"{fig('light_ttft_p99_ms', ms, 'idle')} idle, "
            f"{fig('light_ttft_p99_ms', ms, 'flood')} flooded: "
            f"{ratio.text(times(2), bold=True)} (in steps: "
            f"{fig('light_ttft_p99_steps', number(), 'idle')} and "
            f"{fig('light_ttft_p99_steps', number(), 'flood')}; a flooded step takes "
            f"{fig('step_ms_ratio', times(1))} an idle one)",
            f"≤ 1.5× ({'met' if ratio.meets(1.5, False) else 'not met'})",
        ],
        [
            "the heavier key's share of the KV blocks held, weights 3 and 1, both backlogged",
            f"{share.text(percent(1), bold=True)} (of the step tokens: "
            f"{fig('heavy_token_share', percent(1))})",
            f"75 % ± 10 % ({'met' if share.low >= 0.675 and share.high <= 0.825 else 'not met'})",
        ],
        [
            "the checkpoint's writes (the tokens to their events streams), in tokens/s",
            f"{cost.text(percent(1), bold=True)} fewer by default (every step's, on the "
            f"writer's thread), {fig('checkpoint_cost_in_loop', percent(1))} in the loop, "
            f"{spaced.text(percent(1), bold=True)} every 50 ms",
            f"≤ 5 % (by default: {'met' if cost.meets(0.05, False) else 'not met'}; "
            f"every 50 ms: {'met' if spaced.meets(0.05, False) else 'not met'})",
        ],
    ]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of "
        f"{counted(len(doc['rounds']), 'repeat', 'repeats')} (min–max). A {m['arch']}-shaped "
        f"model of {m['layers']} layers, hidden {m['hidden']} (random weights), "
        f"{s['precision']} on `{s['device']}`, stepped by the worker's engine in one process; "
        f"max_running {s['limits']['max_running']}, step_tokens {s['limits']['step_tokens']}, "
        f"prefill_chunk_tokens {s['limits']['prefill_chunk_tokens']}.",
        "",
        *table(["promise", "measured", "target"], "lll", rows),
    ]


def render_generation_resume(results: Results) -> list[str]:
    doc = results["generation_resume"]
    s, checks = doc["settings"], doc["checks"]
    sec = number(2, " s")

    def fig(name: str, fmt: Fmt = sec, bold: bool = False) -> str:
        return Figure.summary(doc[name]).text(fmt, bold)

    visibility = f"{s['visibility_timeout_s']:g} s"
    rows = [
        ["the job uninterrupted", fig("uninterrupted_s")],
        [f"its worker killed after {s['kill_at_tokens']} tokens", fig("killed_s")],
        ["extra latency", fig("extra_s", bold=True)],
        [f"of which past the visibility timeout ({visibility})", fig("extra_less_visibility_s")],
        ["kill → another worker takes the entry over", fig("kill_to_takeover_s")],
        ["takeover → the job running again", fig("takeover_to_resume_s")],
        ["running again → its first new token", fig("resume_to_first_token_s")],
        ["tokens lost per crash", fig("tokens_lost", number(), bold=True)],
        ["tokens generated again (the last streamed, recomputed)",
         fig("tokens_generated_again", number())],
    ]  # fmt: skip
    n = checks["repeats"]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; median of "
        f"{counted(n, 'repeat', 'repeats')} (min–max). {s['workers']} generation workers "
        f"on `{s['device']}` ({s['stack']}); one greedy job of {s['max_tokens']} tokens, "
        f"each step held to {s['min_step_ms']} ms at least; latency is "
        f"{s['latency']}.",
        "",
        *table(["", "seconds or tokens"], "lr", rows),
        "",
        f"Output equal to the uninterrupted run's, token for token: {checks['output_equal']} "
        f"of {n}; every token index once in the stream: {checks['every_index_once']} of {n}; "
        f"taken over exactly once: {checks['taken_over_once']} of {n}.",
    ]


# --- the README's headline ------------------------------------------------------------------


def render_headline(results: Results) -> list[str]:
    """The README's bullets: each benchmark's headline figure against its target."""
    return [
        headline_scheduler(results["scheduler"]),
        headline_e2e(results["e2e"]),
        headline_backfill(results["backfill"]),
        headline_fairness(results["fairness"]),
        headline_pipeline(results["pipeline"]),
        headline_api(results["api"]),
        *headline_backends(results["backends"]),
        # Measured only where the bench extra (Ray) is installed.
        *([headline_peers(results["peers"])] if results.has("peers") else []),
        # Measured only where a GPU was lent (bench/gpu_check.sh).
        *(
            [headline_gpu(results["gpu"], results["generation_gpu"])]
            if results.has("gpu") and results.has("generation_gpu")
            else []
        ),
    ]


def headline_gpu(gpu: Doc, generation: Doc) -> str:
    minilm = next(model for model in gpu["models"] if model["model"] == "minilm")
    share, rate, _ = GPU_TARGETS["minilm"]
    met = minilm["stack_share_of_raw"] >= (share or 0) and minilm["stack_jobs_per_s"] >= rate
    targets = generation["targets"]

    def ratio(system: str) -> str:
        found = targets[system]
        return (
            f"{Figure.summary(found['ratio']).text(times())} {GENERATION_SYSTEMS[system]} "
            f"(target {found['tokens_per_s_ratio_at_least']:g}×: {verdict(found['met'])})"
        )

    model = generation["settings"]["model"]
    return (
        f"- **On a GPU** ({gpu['device']}, {day(gpu)}, the first run, one round): "
        f"all-MiniLM-L6-v2 in {gpu['precision']} through the whole stack at "
        f"**{minilm['stack_jobs_per_s']:,.0f}** jobs/s, "
        f"{percent(1)(minilm['stack_share_of_raw'])} of the runtime's raw ceiling (target "
        f"{percent()(share or 0)} and {rate:,.0f}/s: {verdict(met)}). Generation "
        f"({generation['settings']['precision']}, a {model['layers']}-layer "
        f"{model['arch']}-shaped model, {generation['settings']['requests']} requests at once): "
        f"Ferry's output tokens/s are {ratio('single')} and {ratio('static')}."
    )


def headline_scheduler(sim: Doc) -> str:
    t = scheduler_targets(sim)
    fixed, ferry = _run_at(sim, "fixed", "poisson", 0.8), _run_at(sim, "ferry", "poisson", 0.8)
    capacity, efficiency, urgent = t["capacity_ratio"], t["efficiency"], t["urgent_ratio"]
    deadline = sim["lanes"]["deadlines_s"]["normal"]
    return (
        "- **Scheduling.** In a discrete-event simulation that runs Ferry's real scheduler "
        "against the batching Triton, Ray Serve and TorchServe do (32 jobs or 5 ms, first "
        f"come first served) on {sim['corpus']['texts']:,} real English paragraphs, Ferry "
        f"sustains {capacity.text(times(), True)} the throughput of fixed batching (target "
        f"1.3×: {verdict(capacity.meets(1.3, True))}) with {efficiency.text(number(2), True)} "
        f"batch efficiency (fixed: {fixed['efficiency_mean']:.2f}; target 0.9: "
        f"{verdict(efficiency.meets(0.9, True))}), keeps the urgent lane's p99 within "
        f"{urgent.text(times())} of its idle value at 80 % load ({t['urgent_80'].median:.1f} "
        f"ms; target 1.2×: {verdict(urgent.meets(1.2, False))}), and misses at most "
        f"{percent(2)(t['misses'].high)} of its deadlines up to 90 % load. The normal lane "
        f"pays: its p99 at 80 % load is {ferry['lanes']['normal']['p99_ms']:.0f} ms (fixed: "
        f"{fixed['lanes']['normal']['p99_ms']:.0f} ms), inside its {deadline:g} s deadline."
    )


def headline_e2e(doc: Doc) -> str:
    ferry = e2e_figures(doc)["ferry"]
    share, gain = ferry["drain_share_of_raw"], ferry["drain_vs_none"]
    return (
        f"- **End to end** (HTTP, Redis, SQLite, all-MiniLM-L6-v2 on {machine_text(doc)}), a "
        f"Ferry worker drains a saturated queue at {share.text(percent(), True)} of the "
        f"model's raw ceiling (target 85 %: {verdict(share.meets(0.85, True))}) and "
        f"{gain.text(times())} batching off (target 3×: {verdict(gain.meets(3.0, True))})."
    )


def headline_backfill(doc: Doc) -> str:
    runs = runs_of(doc)
    busy = Figure.of(r["p99_busy_ms"] for r in runs)
    alone = Figure.of(r["alone_share_of_raw"] for r in runs)
    met = all(r["target_met_full_batch"] for r in runs)
    return (
        "- **Backfills beside live traffic.** On the same stack with the sim model, beside a "
        f"backfill that saturates the model, {runs[0]['rate_per_s']:g} interactive jobs/s see "
        f"a p99 of {busy.text(number(0, ' ms'), True)} (target: idle p99 plus one full batch, "
        f"{verdict(met)}); the backfill alone runs at {alone.text(percent(), True)} of the "
        "raw model."
    )


def headline_fairness(doc: Doc) -> str:
    runs = runs_of(doc)
    flood = runs[0].get("flood_jobs") or doc["settings"]["flood_jobs"]
    own = max(r["phases"][1]["batches_ahead_max"] for r in runs)
    shared = max(r["phases"][2]["batches_ahead_max"] for r in runs)
    return (
        f"- **Fair share.** A tenant that floods a lane with {flood:,} jobs holds back another "
        f"tenant's job by **{batches(own)} at most** (behind a shared queue: up to "
        f"{batches(shared)})."
    )


def headline_pipeline(doc: Doc) -> str:
    figures = pipeline_figures(doc)
    sqlite = figures[("sqlite", "three-stage")]
    postgres = figures.get(("postgresql", "three-stage"))
    on_postgres = f" ({postgres['vs_plain'].text(times())} on PostgreSQL)" if postgres else ""
    plain_idle = figures[("sqlite", "plain")]["device_idle"]
    return (
        f"- **The worker's pipeline** drains a queue {sqlite['vs_plain'].text(times(), True)} "
        f"faster on SQLite{on_postgres} than a worker that does each step in turn: a fast "
        f"stand-in GPU idles {sqlite['device_idle'].text(percent(), True)} of the time instead "
        f"of {plain_idle.text(percent())}."
    )


def headline_api(doc: Doc) -> str:
    sqlite = [s for s in doc["stacks"] if s["database"] == "sqlite" and not s.get("error")]
    one = next(s for s in sqlite if s["api_processes"] == 1)
    two = next((s for s in sqlite if s["api_processes"] == 2), None)
    submit, gets = one["summary"]["submit"], one["summary"]["get"]
    ratio = Figure.summary(one["ratios"]["submit_per_bare"])
    with_two = (
        f" ({Figure.summary(two['summary']['get']['requests_per_s']).text(number())} with two"
        " processes)"
        if two
        else ""
    )
    return (
        f"- **The API**, one process under `wrk` with {doc['settings']['connections']} "
        f"connections, takes {Figure.summary(submit['requests_per_s']).text(number(), True)} "
        "submissions/s at "
        f"{Figure.summary(submit['cpu_ms_per_job']['api']).text(number(2, ' ms'), True)} of "
        f"API CPU each and answers {Figure.summary(gets['requests_per_s']).text(number(), True)}"
        f" GETs/s{with_two}: {ratio.text(times())} a bare FastAPI endpoint (target 0.5×: "
        f"{verdict(ratio.meets(0.5, True))})."
    )


def headline_backends(doc: Doc) -> list[str]:
    found = {b["backend"]: b for b in doc["backends"] if not b.get("error")}
    if "onnx" not in found or "torch.compile" not in found:
        return []

    def ratio(backend: str, order: str) -> str:
        return Figure.of(found[backend]["orders"][order]["ratios_to_eager"]).text(times())

    return [
        "- **Backends.** all-MiniLM-L6-v2 alone on the CPU, embeddings/s against PyTorch "
        f"eager: ONNX Runtime {ratio('onnx', 'sorted')} on length-sorted batches and "
        f"{ratio('onnx', 'arrival')} on padded ones, torch.compile "
        f"{ratio('torch.compile', 'sorted')} and {ratio('torch.compile', 'arrival')}."
    ]


# --- the inference protocol (oip.json) ------------------------------------------------------

OIP_WAYS = {
    "wait": "`POST /v1/jobs?wait=` (JSON)",
    "infer": "`POST /v2/models/minilm/infer` (binary tensors)",
    "grpc": "gRPC `ModelInfer` (raw tensors)",
}


def render_oip(results: Results) -> list[str]:
    doc = results["oip"]
    s = doc["settings"]
    ms = number(1, " ms")
    rows = []
    for way, name in OIP_WAYS.items():
        f = {k: Figure.summary(v) for k, v in doc["ways"][way].items()}
        rows.append(
            [name, f["per_s"].text(number(1), way != "wait")]
            + [f[k].text(number(0, " ms")) for k in ("p50_ms", "p99_ms")]
            + [f["api_cpu_ms_per_request"].text(ms)]
        )
    target = doc["target"]
    verdicts = []
    for way, name in (("infer", "REST's infer"), ("grpc", "gRPC's")):
        rate = Figure.summary(doc["ratios"][way]["per_s"]).text(times(), True)
        cpu = Figure.summary(doc["ratios"][way]["api_cpu"]).text(times())
        met = target[way]
        verdicts.append(
            f"{name}: requests/s {rate} (target ≥ {target['per_s_at_least']:g}×: "
            f"{verdict(met['per_s_met'])}), API CPU a request {cpu} (target ≤ "
            f"{target['api_cpu_at_most']:g}×: {verdict(met['api_cpu_met'])})"
        )
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; minilm, "
        f"{s['clients']} closed-loop clients, {s['duration_s']:g} s measured after "
        f"{s['warmup_s']:g} s of warm-up, each way in each of "
        f"{counted(s['rounds'], 'round', 'rounds')} (median, min–max); the stack serves "
        "gRPC throughout:",
        "",
        *table(["way", "requests/s", "p50", "p99", "API CPU a request"], "lrrrr", rows),
        "",
        "The protocol over the one round trip, round by round: " + "; ".join(verdicts) + ".",
    ]


# --- on a GPU (gpu.json) --------------------------------------------------------------------

# The targets on an H200, per model: (share of raw at least, jobs/s at least, p99 ms at most).
GPU_TARGETS = {"minilm": (0.8, 10_000.0, None), "resnet50": (None, 2_000.0, 100.0)}


def render_gpu(results: Results) -> list[str]:
    doc = results["gpu"]
    sizes = [str(size) for size in doc["settings"]["raw_batch_sizes"]]
    found = {model["model"]: model for model in doc["models"]}
    raw_rows = [[name, *(f"{model['raw_by_batch'][b]:,.0f}" for b in sizes)]
                for name, model in found.items()]  # fmt: skip
    stack_rows = [
        [
            name,
            f"**{model['stack_jobs_per_s']:,.0f}**",
            percent(1)(model["stack_share_of_raw"]),
            percent(1)(model["stack_device_idle"]),
            f"{model['plain_jobs_per_s']:,.0f}",
            percent(1)(model["plain_device_idle"]),
            f"{model['load_per_s']:,.0f}/s: {model['p50_ms']:,.0f} ms, {model['p99_ms']:,.0f} ms",
        ]
        for name, model in found.items()
    ]
    targets = []
    for name, (share, rate, p99) in GPU_TARGETS.items():
        model = found.get(name)
        if model is None:
            targets.append(f"- {name}: not measured in this run.")
            continue
        parts, met = [], True
        if share is not None:
            parts.append(f"≥ {percent()(share)} of raw ({percent(1)(model['stack_share_of_raw'])})")
            met &= model["stack_share_of_raw"] >= share
        parts.append(f"≥ {rate:,.0f} jobs/s ({model['stack_jobs_per_s']:,.0f})")
        met &= model["stack_jobs_per_s"] >= rate
        if p99 is not None:
            parts.append(f"p99 ≤ {p99:,.0f} ms at 70 % load ({model['p99_ms']:,.0f} ms)")
            met &= model["p99_ms"] <= p99
        targets.append(f"- {name}: {', '.join(parts)}: {verdict(met)}.")

    def batches(found: Doc) -> str:
        stages = ", ".join(f"{k} {v:,.1f}" for k, v in found["stage_ms_per_batch"].items())
        return f"{found['batches']:,} batches of {found['mean_batch']:g} jobs on average ({stages})"

    # Files before the first run's did not record the worker's batches.
    recorded = [
        f"- {name}'s batches, ms a batch in each stage: pipelined, "
        f"{batches(model['stack_batches'])}; plain, {batches(model['plain_batches'])}."
        for name, model in found.items()
        if model.get("stack_batches") and model.get("plain_batches")
    ]
    return [
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}; {doc['precision']} on "
        f"{doc['device']}, one run. Raw, the runtime alone, items/s by batch size:",
        "",
        *table(["model", *sizes], "l" + "r" * len(sizes), raw_rows),
        "",
        "Through the whole stack (one worker), jobs/s; the GPU's idle share; "
        "open-loop load at 70 % of saturation: p50 and p99 of accepted → finished:",
        "",
        *table(
            ["model", "saturated", "share of raw", "GPU idle", "plain worker", "its GPU idle",
             "70 % load: p50, p99"],
            "lrrrrrl",
            stack_rows,
        ),
        "",
        *recorded,
        *targets,
    ]  # fmt: skip


# --- the fault-injection suite (faults.json, make faults) ----------------------------------


def fault_scenarios(results: Results, generation: bool) -> list[Doc]:
    """The scenarios of ``make faults``'s run, in the suite's order (its test ids)."""
    doc = results["faults"]
    found = [s for s in doc["scenarios"] if ("tokens_lost" in s["details"]) == generation]
    return sorted(found, key=lambda s: (s["details"].get("test", ""), s["scenario"]))


def faults_intro(results: Results) -> str:
    doc = results["faults"]
    failed = doc["settings"].get("tests_failed", 0)
    verdict = "every test passed" if not failed else f"**{failed} tests failed**"
    return (
        f"{day(doc)}, {machine_text(doc)}, {commit_text(doc)}, `make faults` "
        f"({verdict}; the counts are the witnesses'):"
    )


def render_faults(results: Results) -> list[str]:
    rows = [
        [
            s["scenario"],
            f"{s['submitted']:,}",
            f"{s['completed']:,}",
            str(s["lost"]),
            f"{s['executions']:,}",
            str(s["after_crash"]),
            str(s["run_twice"]),
            str(s["written_twice"]),
            f"{s['seconds']:.1f}",
        ]
        for s in fault_scenarios(results, generation=False)
    ]
    header = ["scenario", "submitted", "completed", "lost", "computations",
              "again after a crash", "computed twice", "written twice", "seconds"]  # fmt: skip
    return [faults_intro(results), "", *table(header, "l" + "r" * 8, rows)]


def render_faults_generation(results: Results) -> list[str]:
    rows = []
    for s in fault_scenarios(results, generation=True):
        d = s["details"]
        rows.append(
            [
                s["scenario"],
                str(s["submitted"]),
                str(s["completed"]),
                str(s["lost"]),
                str(s["executions"]),
                str(s["after_crash"]),
                str(s["run_twice"]),
                str(d["tokens_lost"]),
                f"{d['streamed_twice']} / {d['stream_gaps']}",
                str(s["written_twice"]),
                f"{s['seconds']:.1f}",
            ]
        )
    header = ["generation scenario", "submitted", "completed", "lost", "runs", "taken over",
              "restarted from zero", "tokens lost", "token indices twice / missing",
              "written twice", "seconds"]  # fmt: skip
    return [faults_intro(results), "", *table(header, "l" + "r" * 10, rows)]


RENDERERS: dict[str, Callable[[Results], list[str]]] = {
    "headline": render_headline,
    "scheduler-capacity": render_scheduler_capacity,
    "scheduler-runs": render_scheduler_runs,
    "scheduler-common": render_scheduler_common,
    "scheduler-targets": render_scheduler_targets,
    "scheduler-floors": render_scheduler_floors,
    "scheduler-sensitivity": render_scheduler_sensitivity,
    "scheduler-baselines": render_scheduler_baselines,
    "e2e": render_e2e,
    "e2e-targets": render_e2e_targets,
    "api": render_api,
    "api-targets": render_api_targets,
    "clients-raw": render_clients_raw,
    "clients": render_clients,
    "clients-target": render_clients_target,
    "soak": render_soak,
    "backfill-latency": render_backfill_latency,
    "backfill-throughput": render_backfill_throughput,
    "backfill-target": render_backfill_target,
    "fairness": render_fairness,
    "backends": render_backends,
    "pipeline": render_pipeline,
    "recording": render_recording,
    "sentinel": render_sentinel,
    "cluster": render_cluster,
    "capacity": render_capacity,
    "peers": render_peers,
    "mutation": render_mutation,
    "generation": render_generation,
    "generation-targets": render_generation_targets,
    "generation-chunked": render_generation_chunked,
    "generation-profile": render_generation_profile,
    "generation_stack": render_generation_stack,
    "generation_promises": render_generation_promises,
    "generation_resume": render_generation_resume,
    "generation_gpu": render_generation_gpu,
    "oip": render_oip,
    "gpu": render_gpu,
    "faults": render_faults,
    "faults-generation": render_faults_generation,
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
