"""Payload keys on the real dev server: rotation in two phases under running
workflows, and a key no worker has made visible instead of a silent wedge."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import uuid

from temporalio.client import Client, WorkflowHistory
from temporalio.worker import Replayer

from activities.sweep_activities import SweepActivities
from roundtable.codec import EncryptionCodec, derive_payload_key
from roundtable.models import Decision, RunResult
from roundtable.temporal import data_converter
from roundtable.workflow_runner import workflow_runner
from tests.workflow_harness import Harness, harness, script, ticket_call
from workflows.roundtable import RoundtableWorkflow

ONE_WRITE = script(("seat-1", 1, [ticket_call("ticket_update")]))


def keyring(*names: str) -> list[tuple[str, bytes]]:
    return [(name, derive_payload_key(f"secret-of-{name}")) for name in names]


def client_with(h: Harness, *names: str) -> Client:
    """A client of the same server whose codec holds these keys (first encodes)."""
    return Client(
        h.client.service_client,
        namespace=h.client.namespace,
        data_converter=data_converter(EncryptionCodec(keyring(*names))),
    )


async def pending(h: Harness, client: Client, run_id: str) -> str:
    for _ in range(400):
        state = await client.get_workflow_handle(run_id).query(RoundtableWorkflow.state)
        if state.pending_approvals:
            return next(iter(state.pending_approvals))
        await asyncio.sleep(0.05)
    raise AssertionError("no pending approval")


async def start(h: Harness, client: Client) -> str:
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    from roundtable.models import RunInput, WorkflowArgs

    await client.start_workflow(
        RoundtableWorkflow.run,
        WorkflowArgs(request=RunInput(task_text="t", script=ONE_WRITE, run_id=run_id)),
        id=run_id,
        task_queue=h.task_queue,
    )
    return run_id


async def approve(client: Client, run_id: str, approval_id: str) -> None:
    await client.get_workflow_handle(run_id).execute_update(
        RoundtableWorkflow.decide_approval,
        Decision(approval_id=approval_id, decision="approved", decided_by="op"),
    )


async def test_key_rotation_in_two_phases_under_running_workflows(tmp_path) -> None:
    old, new = f"k-old-{uuid.uuid4().hex[:6]}", f"k-new-{uuid.uuid4().hex[:6]}"
    first = data_converter(EncryptionCodec(keyring(old)))
    async with harness(tmp_path, dev_server=True, converter=first) as h:
        a = await start(h, h.client)
        a_approval = await pending(h, h.client, a)

        # Phase 1: the new key goes in *second* everywhere: all can read it, none writes it.
        phase1 = client_with(h, old, new)
        await h.stop_worker()
        await h.start_worker(phase1)
        b = await start(h, phase1)
        await approve(phase1, a, a_approval)

        # Phase 2: the new key moves first: it writes, the old one still reads.
        phase2 = client_with(h, new, old)
        await h.stop_worker()
        await h.start_worker(phase2)
        await approve(phase2, b, await pending(h, phase2, b))
        c = await start(h, phase2)
        await approve(phase2, c, await pending(h, phase2, c))

        for run_id in (a, b, c):
            result = await phase2.get_workflow_handle(run_id, result_type=RunResult).result()
            assert result.status == "completed"
        assert len(await h.tickets.write_log()) == 3

        # Histories written under the old key still need it: it may go only
        # once no open history (or replay) holds payloads sealed with it.
        history = await phase2.get_workflow_handle(a).fetch_history()
        for names, replays in (((new, old), True), ((new,), False)):
            replayer = Replayer(
                workflows=[RoundtableWorkflow],
                data_converter=data_converter(EncryptionCodec(keyring(*names))),
                workflow_runner=workflow_runner(),
            )
            outcome = await replayer.replay_workflow(
                WorkflowHistory.from_json(a, history.to_json()), raise_on_replay_failure=False
            )
            assert (outcome.replay_failure is None) == replays


async def test_a_key_no_worker_has_stalls_the_run_visibly_until_it_is_added(
    tmp_path, caplog
) -> None:
    missing, other = f"k-lost-{uuid.uuid4().hex[:6]}", f"k-other-{uuid.uuid4().hex[:6]}"
    first = data_converter(EncryptionCodec(keyring(missing)))
    caplog.set_level(logging.ERROR, logger="roundtable.codec")
    async with harness(tmp_path, dev_server=True, converter=first) as h:
        run_id = await start(h, h.client)
        approval_id = await pending(h, h.client, run_id)
        lacking = client_with(h, other)
        await h.stop_worker()
        await h.start_worker(lacking)  # a worker without the run's key
        await h.client.get_workflow_handle(run_id).signal(RoundtableWorkflow.refresh)

        sweep = SweepActivities(h.store, lacking)  # the sweep runs on such a worker
        for _ in range(300):
            _, stalled = await sweep.check_runs()
            if stalled:
                break
            await asyncio.sleep(0.1)
        assert stalled == [run_id]
        run = await h.store.get_run(run_id)
        assert run["status"] == "stalled"
        assert run["failure"]["code"] == "workflow_task_failing"
        assert missing in run["failure"]["message"]
        said = [r.getMessage() for r in caplog.records if missing in r.getMessage()]
        assert len(said) == 1  # once, however often the task fails

        both = client_with(h, other, missing)
        await h.stop_worker()
        await h.start_worker(both)  # the key is added
        await both.get_workflow_handle(run_id).signal(RoundtableWorkflow.refresh)
        for _ in range(300):
            await sweep.check_runs()
            if (await h.store.get_run(run_id))["status"] != "stalled":
                break
            await asyncio.sleep(0.1)
        run = await h.store.get_run(run_id)
        assert run["status"] == "waiting_input" and run["failure"] is None
        await approve(both, run_id, approval_id)
        result = await both.get_workflow_handle(run_id, result_type=RunResult).result()
        assert result.status == "completed"


METRIC_PROBE = """
import asyncio
from temporalio.api.common.v1 import Payload
from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig
from roundtable.codec import ENCODING, KEY_ID, EncryptionCodec, PayloadKeyError

buffer = MetricBuffer(100)
Runtime.set_default(Runtime(telemetry=TelemetryConfig(metrics=buffer)), error_if_already_set=True)
codec = EncryptionCodec([("k1", b"0" * 32)])
sealed = Payload(metadata={"encoding": ENCODING, KEY_ID: b"k9"}, data=b"x" * 40)
for _ in range(3):
    try:
        asyncio.run(codec.decode([sealed]))
    except PayloadKeyError:
        pass
for update in buffer.retrieve_updates():
    print(update.metric.name, update.value, dict(update.attributes).get("key_id"))
"""


def test_every_undecryptable_payload_is_counted_in_the_metrics() -> None:
    done = subprocess.run(
        [sys.executable, "-c", METRIC_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [line for line in done.stdout.splitlines() if "payload_key_missing" in line]
    assert lines == ["roundtable_payload_key_missing 1 k9"] * 3, done.stdout
