"""Operations: what lets a person run Ferry and see into it.

Structured logs (``logs``), the Prometheus metrics every process exports
(``metrics``) and a worker's own /metrics, /healthz and /readyz port
(``health``), OpenTelemetry traces (``tracing``), the garbage collector in the
long-lived processes (``collector``), the desired-workers signal an
autoscaler reads (``autoscale``), and the guard on the URLs Ferry calls out to
(``urlguard``). May import ``core.config``, ``core.models`` and ``core.streams``; no
other part of ``core`` imports it.
"""
