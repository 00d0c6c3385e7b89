"""One trace follows a run: from ``POST /v1/runs`` through the workflow and
its activities to the tool call, exported to an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from roundtable.telemetry.tracing import start_tracing, temporal_interceptors, tracing_configured
from tests.api_server import serve_api
from tests.test_closed_runs import AUTO, update
from tests.workflow_harness import harness

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    """The process's tracer provider can be set once: this module's, kept."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another test set the global tracer provider first")
    return _EXPORTER


def _parents(spans: list[ReadableSpan]) -> dict[int, ReadableSpan]:
    return {s.context.span_id: s for s in spans}


def _ancestry(span: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[str]:
    names = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        names.append(span.name)
    return names


async def test_one_trace_from_the_http_request_to_the_tool_call(tmp_path, spans) -> None:
    spans.clear()
    async with (
        harness(tmp_path, interceptors=temporal_interceptors(True)) as h,
        serve_api(h, tracing=True, policy_ceiling_service=AUTO) as api,
    ):
        body = {"task_text": "t", "script": update("T-9"), "write_policy": AUTO, "user_id": "u-1"}
        started = await api.http.post("/v1/runs", json=body, headers=api.auth("svc"))
        assert started.status_code == 201, started.text
        run_id = started.json()["run_id"]
        handle = h.client.get_workflow_handle(run_id)
        await handle.result()

    finished = spans.get_finished_spans()
    (request,) = [s for s in finished if s.name == "POST /v1/runs"]
    in_trace = [s for s in finished if s.context.trace_id == request.context.trace_id]
    by_id = _parents(in_trace)
    names = {s.name for s in in_trace}
    for expected in (
        "StartWorkflow:RoundtableWorkflow",
        "RunWorkflow:RoundtableWorkflow",
        "StartActivity:execute_write",
        "RunActivity:execute_write",
        "tool ticket_update",
    ):
        assert expected in names, sorted(names)
    (tool,) = [s for s in in_trace if s.name == "tool ticket_update"]
    # The tool call hangs from its activity, scheduled by the workflow the
    # request started: one unbroken chain back to the request.
    path = _ancestry(tool, by_id)
    assert path == [
        "RunActivity:execute_write",
        "StartActivity:execute_write",
        "StartWorkflow:RoundtableWorkflow",
        "POST /v1/runs",
    ], path
    assert tool.attributes["roundtable.run_id"] == run_id
    # Tool arguments never reach a span.
    assert not any("T-9" in str(dict(s.attributes or {})) for s in in_trace)


def test_tracing_is_on_only_when_the_standard_variables_ask(monkeypatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing_configured() and not start_tracing("t")
    assert temporal_interceptors(False) == []
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing_configured()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing_configured()
