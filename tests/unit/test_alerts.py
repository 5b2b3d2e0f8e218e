"""deploy/prometheus/alerts.yml: every alert passes its promtool unit tests, asks only for
series Ferry exports and jobs Prometheus scrapes, and Prometheus loads the file.

promtool comes from Debian's prometheus package (.ci/run installs it). Without
it these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dashboard import METRIC, PROMETHEUS, ROOT, family
from tests.promtool import promtool

ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
# The scrape jobs alerts.yml names: the same in every configuration.
JOBS = {"ferry-api", "ferry-worker", "ferry-celery", "flower"}


def rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_passes_its_promtool_tests() -> None:
    promtool("check", "rules", ALERTS.name, cwd=ALERTS.parent)
    promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)


def test_every_alert_is_tested_firing_and_quiet() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    cases = [case for test in tests["tests"] for case in test["alert_rule_test"]]
    for rule in rules():
        if "alert" not in rule:
            continue
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{rule['alert']} never fires in a test"
        assert any(not case["exp_alerts"] for case in mine), f"{rule['alert']} never stays quiet"


def test_alerts_ask_for_series_ferry_exports_and_jobs_prometheus_scrapes() -> None:
    exported = {
        family(name)
        for name in re.findall(
            r'"(ferry_[a-z0-9_]+)"', (ROOT / "core" / "ops" / "metrics.py").read_text()
        )
    }
    jobs = {job["job_name"] for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    for rule in rules():
        expr = rule["expr"]
        unknown = {name for name in METRIC.findall(expr) if family(name) not in exported}
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)
        for pattern in re.findall(r'job=~?"([^"]+)"', expr):
            assert set(pattern.split("|")) <= jobs, (rule.get("alert"), pattern)
        assert rule.get("alert") or ":" in rule["record"]  # recording rules: level:metric:op


def test_compose_mounts_the_alerts_beside_prometheus_config() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["prometheus"]
    mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in compose["volumes"]}
    config_path = Path("/etc/prometheus/prometheus.yml")
    assert mounts[str(config_path)] == "./deploy/prometheus/prometheus.yml"
    for rule_file in yaml.safe_load(PROMETHEUS.read_text())["rule_files"]:
        assert mounts[str(config_path.parent / rule_file)] == f"./deploy/prometheus/{rule_file}"


@pytest.mark.parametrize("name", ["prometheus.yml", "kubernetes.yml"])
def test_prometheus_loads_the_alerts(tmp_path: Path, name: str) -> None:
    """Compose's configuration and the one for Kubernetes (docs/kubernetes.md)."""
    config = yaml.safe_load((PROMETHEUS.parent / name).read_text())
    assert config["rule_files"] == [ALERTS.name]
    assert {job["job_name"] for job in config["scrape_configs"]} == JOBS
    # promtool reads the scrape token's file too: one of ours stands in for it.
    token = tmp_path / "token"
    token.write_text("x")
    for job in config["scrape_configs"]:
        job["authorization"]["credentials_file"] = str(token)
        # Debian's promtool is built without Kubernetes discovery: a static
        # target stands in for it, and its own fields are checked here.
        for discovery in job.pop("kubernetes_sd_configs", []):
            assert discovery == {"role": "pod", "namespaces": {"names": ["ferry"]}}
            job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    (tmp_path / name).write_text(yaml.safe_dump(config))
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    promtool("check", "config", name, cwd=tmp_path)
