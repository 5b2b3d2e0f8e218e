"""OpenTelemetry traces: off unless the standard ``OTEL_*`` variables ask for them.

On when an OTLP endpoint is named (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), unless ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none``; the exporter (OTLP over HTTP) and the batch
processor read the rest of the standard variables themselves
(``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_BSP_*``, ...).

A job's trace starts at its HTTP request; its W3C ``traceparent`` is kept
with the job (the ``jobs.trace_context`` column) and travels in its stream
entry, so the worker's spans (the wait in the queue, its run in a batch, the
result write) and the webhook delivery's join that trace. A batch serves many
traces: it has a trace of its own, linked to every job's.

Off, every function here returns at once: no span is made.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
_NO_OP: Tracer = trace.NoOpTracer()
_tracer: Tracer = _NO_OP
_provider: Any = None


def wanted(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def endpoint(environ: Mapping[str, str]) -> str:
    """Where spans go: the traces endpoint as given, or the base endpoint's /v1/traces."""
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"


def setup(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Export this process's spans over OTLP/HTTP if the environment asks; True if on.

    ``service``: the process's part (api, worker-minilm, celery-worker), the
    service name unless ``OTEL_SERVICE_NAME`` gives one.
    """
    global _tracer, _provider
    if not wanted(environ):
        return False
    # The SDK only when asked for: off, a process never imports it.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    shutdown()
    name = environ.get("OTEL_SERVICE_NAME") or f"ferry-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint(environ))))
    _provider = provider
    _tracer = provider.get_tracer("ferry")
    return True


def shutdown() -> None:
    """Send what is buffered and stop (at exit; or before setting up again)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    _tracer = _NO_OP


atexit.register(shutdown)


def on() -> bool:
    return _provider is not None


def tracer() -> Tracer:
    return _tracer


def traceparent() -> str | None:
    """The current span's W3C traceparent (None when tracing is off or no span is current)."""
    if not on():
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def context_of(traceparent: str | None) -> Context | None:
    """The context a traceparent continues (None: a new trace)."""
    if not traceparent or not on():
        return None
    return _PROPAGATOR.extract({"traceparent": traceparent})


def span_context_of(traceparent: str | None) -> trace.SpanContext | None:
    """The remote span a traceparent names (for links), or None."""
    context = context_of(traceparent)
    if context is None:
        return None
    found = trace.get_current_span(context).get_span_context()
    return found if found.is_valid else None


@contextmanager
def span(
    name: str,
    parent: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span | None]:
    """A span around the block, current inside it; ``parent``: a traceparent to continue
    (default: the current span). Yields None when tracing is off."""
    if not on():
        yield None
        return
    with _tracer.start_as_current_span(
        name, context=context_of(parent), kind=kind, attributes=attributes
    ) as current:
        yield current


def start_span(
    name: str,
    parent: str | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, Any] | None = None,
) -> Span | None:
    """A span the caller ends (None when tracing is off); ``parent``: a traceparent."""
    if not on():
        return None
    return _tracer.start_span(name, context=context_of(parent), kind=kind, attributes=attributes)


def inject(headers: dict[str, str], span: Span | None) -> None:
    """Add the span's ``traceparent`` to outgoing HTTP headers (the receiver may continue it)."""
    if span is not None:
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(span))
