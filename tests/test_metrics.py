"""The metrics an SRE's dashboards and alerts rely on, scraped over real HTTP
after real runs: from the worker (served by the Temporal SDK's runtime, ours
beside the SDK's) and from the API."""

from __future__ import annotations

import re
from collections.abc import Iterable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from roundtable.config import Settings
from roundtable.models import Decision
from roundtable.store import open_store
from roundtable.telemetry.gauges import recount
from roundtable.telemetry.metrics import Metrics
from roundtable.telemetry.runtime import MetricsAddressError, metrics_runtime
from tests.api_server import free_port, serve_api, serving
from tests.fake_openai import fake_openai, message
from tests.test_closed_runs import AUTO, update
from tests.test_monitoring_files import metric_names
from tests.test_workflow_execution import wrap_tool
from tests.workflow_harness import harness
from workflows.roundtable import RoundtableWorkflow

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample by (name, labels), the exporter's own service label dropped."""
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if k != "service_name")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


async def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.get(url, headers=headers)
    assert answer.status_code == 200, answer.text
    return parse(answer.text)


async def decide(handle, approval_id: str, decision: str) -> None:  # type: ignore[no-untyped-def]
    await handle.execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision=decision, decided_by="op-1"),
    )


def counted(samples: Samples, name: str) -> Iterable[tuple[dict[str, str], float]]:
    for (sample, labels), v in samples.items():
        if sample == name:
            yield dict(labels), v


async def test_worker_and_api_metrics_after_real_runs(tmp_path, monkeypatch) -> None:
    port = free_port()
    runtime = metrics_runtime(f"127.0.0.1:{port}")
    metrics = Metrics(runtime.metric_meter)
    worker_url = f"http://127.0.0.1:{port}/metrics"

    def replies(body: dict, n: int) -> dict:
        # A model turn that writes T-7, then a closing turn.
        if _first_turn(body):
            return message(calls=[("ticket_update", _t7())], usage=(11, 7))
        return message("done", usage=(5, 3))

    customize = lambda reg, _t: wrap_tool(reg, "ticket_update", loses_the_first_t1)  # noqa: E731
    async with (
        fake_openai(replies) as fake,
        harness(tmp_path, runtime=runtime, metrics=metrics, customize=customize) as h,
    ):
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-real")
        # 1. An approval nobody decides expires (alone: time skips to its end).
        expiring = await h.start(task_text="t", script=update("T-5"), approval_timeout_seconds=60)
        await expiring.result()
        # 2. The first writer's answer is lost: unknown, and T-1 stays blocked.
        lost = await h.start(task_text="t", script=update("T-1", "a"), write_policy=AUTO)
        await h.wait_for(lost, lambda s: bool(s.unknown_actions))
        # 3. A model's write, approved: it runs (the second writer: it succeeds).
        modelled = await h.start(
            task_text="t", model="openai:m", seats=["seat-1"], manager=None, max_rounds=2
        )
        state = await h.wait_for(modelled, lambda s: bool(s.pending_approvals))
        await decide(modelled, next(iter(state.pending_approvals)), "approved")
        # 4. A write rejected by a person.
        rejected = await h.start(task_text="t", script=update("T-2"))
        state = await h.wait_for(rejected, lambda s: bool(s.pending_approvals))
        await decide(rejected, next(iter(state.pending_approvals)), "rejected")
        # 5. A write to the blocked T-1: its claim finds the unknown in the way.
        blocked = await h.start(task_text="t", script=update("T-1", "b"), write_policy=AUTO)
        # 6. An approval left pending.
        waiting = await h.start(task_text="t", script=update("T-3"))
        await h.wait_for(waiting, lambda s: bool(s.pending_approvals))
        with h.env.auto_time_skipping_disabled():
            await modelled.result()
            await rejected.result()
        await recount(h.store, metrics)
        worker = await _scrape_until_busy(worker_url)
        assert (await h.state(blocked)).status != "completed"
        async with serve_api(h) as api:
            await api.http.get("/healthz")  # counted by the time of the scrape
            api_samples = await scrape(f"{api.http.base_url}/metrics", api.auth("ops"))
            refused = await api.http.get("/metrics", headers=api.auth("alice"))
            anonymous = await api.http.get("/metrics")

    # Actions by tool and status: terminal transitions only.
    actions = {
        (labels["tool"], labels["status"]): v
        for labels, v in counted(worker, "roundtable_actions_total")
    }
    assert actions == {
        ("ticket_update", "rejected"): 2,  # the expired one and the rejected one
        ("ticket_update", "unknown"): 1,
        ("ticket_update", "succeeded"): 1,
    }, actions
    # The gauges, counted in the database.
    assert value(worker, "roundtable_approvals_pending") == 1
    assert value(worker, "roundtable_unknown_actions") == 1
    # Approval waits, by outcome: one each.
    for outcome in ("approved", "rejected", "expired"):
        assert value(worker, "roundtable_approval_wait_seconds_count", outcome=outcome) == 1
    # Waits are read on the database's clock (which skipped time does not move).
    assert value(worker, "roundtable_approval_wait_seconds_sum", outcome="expired") > 0
    # Tool calls: two writes ran (one unknown, one succeeded).
    calls = ("roundtable_tool_call_seconds_count", "ticket_update")
    assert value(worker, calls[0], tool=calls[1], status="succeeded") == 1
    assert value(worker, calls[0], tool=calls[1], status="unknown") == 1
    assert value(worker, "roundtable_lease_busy_total", tool="ticket_update") >= 1
    # Tokens: every completion the model sent was counted.
    first_turns = sum(1 for body in fake.requests if _first_turn(body))
    later_turns = len(fake.requests) - first_turns
    assert (first_turns, later_turns) == (1, 1)
    prompt, completion = 11 * first_turns + 5 * later_turns, 7 * first_turns + 3 * later_turns
    tokens = "roundtable_model_tokens_total"
    assert value(worker, tokens, model="openai:m", kind="prompt") == prompt
    assert value(worker, tokens, model="openai:m", kind="completion") == completion
    # The Temporal SDK's own metrics share the address.
    assert any(name.startswith("temporal_") for name in names(worker)), sorted(names(worker))

    # Every metric the dashboard and the alerts name is one we export.
    exported = names(worker) | names(api_samples)
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for n in metric_names()}
    assert used <= {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported}, used - exported

    # The API: the same gauges from the database, and its requests.
    assert value(api_samples, "roundtable_approvals_pending") == 1
    assert value(api_samples, "roundtable_unknown_actions") == 1
    assert refused.status_code == 403
    assert anonymous.status_code == 401


def _first_turn(body: dict) -> bool:
    return not any(m["role"] == "tool" for m in body["messages"])


def loses_the_first_t1(handler):  # type: ignore[no-untyped-def]
    """The first write to T-1 acts, then its answer is lost: unknown."""

    async def handle(args, ctx):  # type: ignore[no-untyped-def]
        ticket = args.get("ticket_id") if isinstance(args, dict) else args.ticket_id
        if ticket == "T-1" and ctx.fencing_token == 1:
            await handler(args, ctx)
            raise ConnectionResetError("connection reset after the write")
        return await handler(args, ctx)

    return handle


async def _scrape_until_busy(url: str) -> Samples:
    """Scrape until the blocked write's claim has met the unknown in its way."""
    import asyncio

    for _ in range(200):
        samples = await scrape(url)
        if value(samples, "roundtable_lease_busy_total", tool="ticket_update") >= 1:
            return samples
        await asyncio.sleep(0.05)
    raise AssertionError("the blocked write never tried its claim")


def _t7() -> dict:
    return {"tenant_id": "acme", "ticket_id": "T-7", "fields": {"owner": "m"}}


async def test_the_api_serves_metrics_without_a_token_only_when_told(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h, api_metrics_public=True) as api:
        samples = parse((await api.http.get("/metrics")).text)
        await api.http.get("/v1/runs/run-nope", headers=api.auth("ops"))
        samples = parse((await api.http.get("/metrics")).text)
    # Requests are labelled by route template: the id in the path is not a label.
    assert (
        value(
            samples,
            "roundtable_http_requests_total",
            method="GET",
            route="/v1/runs/{run_id}",
            status="404",
        )
        == 1
    )
    assert not any("run-nope" in str(labels) for _, labels in samples)


def test_a_held_metrics_port_names_its_holder() -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(MetricsAddressError) as caught:
            metrics_runtime(f"127.0.0.1:{port}")
    said = str(caught.value)
    assert f"127.0.0.1:{port}" in said and "ROUNDTABLE_WORKER_METRICS_ADDRESS" in said
    assert "held by" in said and "pid" in said.lower()


async def test_hostile_methods_do_not_grow_the_request_series(tmp_path) -> None:
    """Any client, with no token, may send any method name (uvicorn's h11
    takes any token): labelled as sent, each would be a new series (a counter
    and a histogram) for ever. Only the standard methods are labels."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'rt.db'}"
    async with open_store(url) as store:
        operator, _ = await store.create_token(user_id="ops", role="operator")
        app = create_app(Settings(database_url=url), store=store, tracing=False)
        async with (
            serving(app) as port,  # over real HTTP: uvicorn (h11) takes any method token
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http,
        ):
            for n in range(50):
                await http.request(f"X{n:04d}", "/v1/runs")
            text = (
                await http.get("/metrics", headers={"Authorization": f"Bearer {operator}"})
            ).text
    methods = {
        s.labels.get("method")
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("roundtable_http_requests")
    }
    assert methods <= {"GET", "other"}, methods
