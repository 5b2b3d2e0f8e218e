"""The Grafana dashboard and Prometheus configuration in deploy/, read as data."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "ferry.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"

METRIC = re.compile(r"\b(ferry_[a-z0-9_]+)\b")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def dashboard() -> dict[str, Any]:
    data = json.loads(DASHBOARD.read_text())
    assert isinstance(data, dict)
    return data


def expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def family(sample_name: str) -> str:
    """The metric family a series name belongs to (histogram parts and _total stripped)."""
    for suffix in (*HISTOGRAM_PARTS, "_total"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def families_used() -> set[str]:
    return {family(name) for expr in expressions() for name in METRIC.findall(expr)}
