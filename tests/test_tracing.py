"""One trace follows a run: from ``POST /v1/runs`` through the workflow and
its activities to the tool call, exported to an in-memory exporter."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.app import create_app
from roundtable.config import Settings
from roundtable.store import open_store
from roundtable.telemetry.tracing import start_tracing, temporal_interceptors, tracing_configured
from tests.api_server import serve_api
from tests.test_closed_runs import AUTO, update
from tests.test_workflow_execution import wrap_tool
from tests.workflow_harness import harness, script, ticket_call

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


SECRET_TICKET = "T-SECRET-4711"


def fails_once_naming_its_arguments(handler):  # type: ignore[no-untyped-def]
    failed = []

    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        if not failed:
            failed.append(1)
            # What a client library says when a request fails: what was asked.
            raise ConnectionError(f"GET /tickets/{args.ticket_id} failed: reset")
        return await handler(args, ctx)

    return handle


async def test_a_failed_read_puts_no_tool_argument_in_a_span(tmp_path, spans) -> None:
    """A tool's error message may quote its arguments: a span records the
    exception's type, never its message or stack."""
    spans.clear()

    def customize(registry, _tickets) -> None:  # type: ignore[no-untyped-def]
        wrap_tool(registry, "ticket_get", fails_once_naming_its_arguments)
        # The demo shows ticket ids; here the id is a value no view may show.
        tool = registry.tools["ticket_get"]
        registry.tools["ticket_get"] = dataclasses.replace(tool, safe_argument_fields=())

    read = script(("seat-1", 1, [ticket_call("ticket_get", SECRET_TICKET)]))
    async with harness(
        tmp_path, interceptors=temporal_interceptors(True), customize=customize
    ) as h:
        handle = await h.start(task_text="t", script=read, write_policy=AUTO)
        await handle.result()
    carried = [
        (s.name, str(e.attributes))
        for s in spans.get_finished_spans()
        for e in s.events
        if SECRET_TICKET in str(e.attributes)
    ] + [
        (s.name, str(s.attributes))
        for s in spans.get_finished_spans()
        if SECRET_TICKET in str(s.attributes)
    ]
    assert not carried, carried[0]


async def test_codec_token_in_the_ui_path_never_reaches_a_span(tmp_path, spans) -> None:
    """The Temporal UI's codec token travels in the path (/codec/t/<token>/);
    the access log redacts it, and the codec endpoints are not traced at all,
    so no span carries it to a collector."""
    spans.clear()
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        token, _ = await store.create_token(user_id="temporal-ui", role="codec")
        app = create_app(Settings(database_url=url), store=store, tracing=True)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://api"
            ) as http,
        ):
            answer = await http.post(f"/codec/t/{token}/decode", json={"payloads": []})
            assert answer.status_code == 200, answer.text
    recorded = [str(dict(s.attributes or {})) + s.name for s in spans.get_finished_spans()]
    assert not [r for r in recorded if token in r]
