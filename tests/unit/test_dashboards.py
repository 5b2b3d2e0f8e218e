"""deploy/: the Prometheus configuration scrapes every process docker-compose.yml runs, and the
Grafana dashboard asks only for metrics and labels that Ferry (or Flower) exports."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

import core.ops.metrics
from core.ops.metrics import queue_metrics
from tests.dashboard import (
    HISTOGRAM_PARTS,
    METRIC,
    PROMETHEUS,
    PROVISIONING,
    ROOT,
    dashboard,
    expressions,
    families_used,
    family,
)
from workers.gpu.gpu_stats import GpuCollector

DURATION = re.compile(r"^\d+(ms|s|m|h|d)$")


def _families() -> dict[str, tuple[str, set[str]]]:
    """Every family Ferry exports: its type and its label names."""
    assert core.ops.metrics  # registered on import
    known: dict[str, tuple[str, set[str]]] = {}
    for value in vars(core.ops.metrics).values():
        names = getattr(value, "_labelnames", None)
        name = getattr(value, "_name", None)
        kind = getattr(value, "_type", None)
        if names is not None and name is not None and kind is not None:
            known[family(name)] = (kind, set(names))
    queues = queue_metrics(redis.Redis(), "unused", [])
    for parsed in text_string_to_metric_families(queues.decode()):
        known[parsed.name] = (parsed.type, {"model", "lane"})
    nvml = SimpleNamespace(
        nvmlDeviceGetUtilizationRates=lambda _h: SimpleNamespace(gpu=50),
        nvmlDeviceGetMemoryInfo=lambda _h: SimpleNamespace(used=1, total=2),
    )
    for metric in GpuCollector(nvml, None, "m", "GPU-0").collect():
        known[metric.name] = (metric.type, {"model", "gpu"})
    return known


# The series each type exports, by suffix.
SERIES = {"counter": ("_total",), "histogram": HISTOGRAM_PARTS, "gauge": ("",)}


def test_the_dashboard_asks_only_for_exported_series_and_labels() -> None:
    known = _families()
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    for expr in expressions():
        names = METRIC.findall(expr)
        labels: set[str] = set()
        for name in names:
            kind, own = known[family(name)]
            # A counter is read as _total, a histogram as _bucket/_sum/_count, a gauge as is.
            assert any(name == family(name) + suffix for suffix in SERIES[kind]), (name, expr)
            labels |= own
        if not names:
            # Prometheus's own `up`, for the jobs its configuration scrapes.
            selected = re.fullmatch(r'sum by \(job\) \(up\{job=~"([^"]+)"\}\)', expr)
            assert selected, expr
            assert set(selected.group(1).split("|")) <= jobs, expr
            continue
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (part.strip() for part in group.split(",")):
                assert label in labels | {"le"}, (label, expr)
        for selector in re.findall(r"\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*=~?", selector):
                assert label in labels, (label, expr)


def test_every_expression_is_balanced_and_bounded_in_time() -> None:
    for expr in expressions():
        depth = {"(": 0, "[": 0, "{": 0}
        closing = {")": "(", "]": "[", "}": "{"}
        for char in expr:
            if char in depth:
                depth[char] += 1
            elif char in closing:
                depth[closing[char]] -= 1
                assert depth[closing[char]] >= 0, expr
        assert set(depth.values()) == {0}, expr
        for window in re.findall(r"\[([^\]]+)\]", expr):
            assert DURATION.match(window), (window, expr)
        # Counters and histograms are only meaningful as rates.
        for name in METRIC.findall(expr):
            if name.endswith(("_total", "_bucket", "_sum", "_count")):
                assert re.search(rf"(rate|increase)\({name}\b", expr), (name, expr)


def test_the_dashboard_covers_what_an_operator_watches() -> None:
    data = dashboard()
    assert data["uid"] and data["title"]
    panels = data["panels"]
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("throughput", "latency per lane", "queue depth", "batch size", "efficiency",
                  "memory", "gpu utilisation", "webhook", "workers online"):  # fmt: skip
        assert topic in titles, topic
    used = families_used()
    for name in ("ferry_jobs_finished", "ferry_job_latency_seconds", "ferry_queue_depth",
                 "ferry_queue_lag", "ferry_batch_size", "ferry_batch_efficiency_ratio",
                 "ferry_batch_latency_seconds", "ferry_batch_predicted_latency_seconds",
                 "ferry_batch_window_seconds", "ferry_worker_memory_bytes",
                 "ferry_webhook_attempts", "ferry_gpu_utilization_ratio"):  # fmt: skip
        assert name in used, name


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), panel["title"]


def test_the_dashboard_uses_the_provisioned_datasource() -> None:
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    data = dashboard()
    refs = [panel["datasource"] for panel in data["panels"]]
    refs += [t["datasource"] for panel in data["panels"] for t in panel["targets"]]
    refs += [v["datasource"] for v in data["templating"]["list"]]
    assert all(ref == {"type": "prometheus", "uid": source["uid"]} for ref in refs)
    # The model filter is applied wherever a metric has a model label.
    for expr in expressions():
        if "model" in expr and "by (model" in expr:
            assert 'model=~"$model"' in expr, expr


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return dict(data["services"])


def _metrics_port(service: dict[str, Any]) -> int | None:
    command = [str(part) for part in service.get("command", [])]
    if "--metrics-port" in command:
        return int(command[command.index("--metrics-port") + 1])
    if command[:1] == ["api"]:
        return 8000
    if command[:1] == ["flower"]:
        return int(service["environment"]["FERRY_FLOWER_PORT"])
    return None


def test_prometheus_scrapes_every_process_that_serves_metrics(services: dict[str, Any]) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    for key in ("scrape_interval", "evaluation_interval"):
        assert DURATION.match(config["global"][key]), key
    scraped: dict[str, int] = {}
    jobs = [job["job_name"] for job in config["scrape_configs"]]
    assert len(set(jobs)) == len(jobs)
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[host] = int(port)
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"
            for host in dns["names"]:
                scraped[host] = int(dns["port"])
    expected = {
        name: port
        for name, service in services.items()
        if (port := _metrics_port(service)) is not None
    }
    assert {"api", "gpu-worker", "sim-worker", "celery-worker", "flower"} <= set(expected)
    assert scraped == expected


def test_grafana_loads_the_dashboard_folder_compose_mounts(services: dict[str, Any]) -> None:
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "ferry.yml").read_text())
    (provider,) = providers["providers"]
    mounts = {
        str(v).split(":")[1]: ROOT / str(v).split(":")[0] for v in services["grafana"]["volumes"]
    }
    folder = mounts[provider["options"]["path"]]
    assert (folder / "ferry.json").is_file()
