"""OpenTelemetry traces: one trace from ``POST /v1/runs`` through the
workflow and its activities to the tool call.

Tracing is on when the standard variables ask for it
(``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``,
unless ``OTEL_SDK_DISABLED=true``); the exporter reads the rest of the
standard variables itself (headers, protocol, timeouts). Off, nothing is
intercepted: the interceptor costs every workflow task and activity something
even with nobody listening.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode
from temporalio.client import Interceptor

_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_installed = False

# Spans of our own (a tool call) join whatever trace is current.
tracer = trace.get_tracer("roundtable")


def tracing_configured() -> bool:
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(os.environ.get(name, "").strip() for name in _ENDPOINTS)


def start_tracing(service: str) -> bool:
    """Export spans over OTLP (HTTP) when configured, once per process;
    whether tracing is on. ``service`` names the process unless
    ``OTEL_SERVICE_NAME`` does."""
    global _installed
    if not tracing_configured():
        return False
    if not _installed:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        named = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service}
        provider = TracerProvider(resource=Resource.create(named))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _installed = True
    return True


def temporal_interceptors(tracing: bool) -> list[Interceptor]:
    """For a client (its workers inherit them): spans for every start,
    signal, update and query, and inside workers for workflows and activities."""
    if not tracing:
        return []
    from temporalio.contrib.opentelemetry import TracingInterceptor

    return [TracingInterceptor()]


# Never traced: the codec endpoints. The Temporal UI's token travels in their
# path (/codec/t/<token>/decode), which a span would export with its URL, and
# they decode payloads, which is nothing a trace needs.
UNTRACED_URLS = "/codec/"


def instrument_api(app: object) -> None:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls=UNTRACED_URLS)  # type: ignore[arg-type]


@contextmanager
def tool_span(tool: str, **ids: str) -> Iterator[Span]:
    """A span around one tool call. An exception is recorded by its type
    only: a tool's error message may quote its arguments."""
    attributes = {f"roundtable.{k}": v for k, v in ids.items()}
    with tracer.start_as_current_span(
        f"tool {tool}", attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
