"""Which /metrics port `ferry up` gives each process it starts."""

from __future__ import annotations

from core.settings import Settings
from ferry.up import metrics_ports


def test_consecutive_ports_in_model_order_then_the_celery_worker() -> None:
    settings = Settings(models="minilm,sim", metrics_port_base=9500)
    assert metrics_ports(settings) == {
        "worker-minilm": 9500,
        "worker-sim": 9501,
        "celery-worker": 9502,
    }


def test_base_zero_serves_no_metrics() -> None:
    assert metrics_ports(Settings(metrics_port_base=0)) == {}
