"""The live event stream ends with the run, and with every event of it: the
last events commit with the run's final status, so a stream that read the
events first and the status after could end one commit short."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from api.routes import runs


class RaceStore:
    """The run's last commit (its final event and status) lands just as the
    stream asks for the run's status."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.status = "running"

    async def get_run(self, run_id: str) -> dict[str, Any]:
        if self.status == "running":
            self.status = "completed"
            self.events.append(
                {
                    "seq": 1,
                    "event_type": "run.status_changed",
                    "payload": {"to": "completed"},
                    "created_at": datetime.now(UTC),
                    "hash": "h",
                }
            )
        return {"id": run_id, "status": self.status}

    async def events_page(self, run_id: str, after_seq: int, limit: int) -> list[dict[str, Any]]:
        return [e for e in self.events if e["seq"] > after_seq][:limit]


class Connected:
    async def is_disconnected(self) -> bool:
        return False


async def test_the_stream_does_not_end_before_the_runs_last_event(monkeypatch) -> None:
    monkeypatch.setattr(runs, "SSE_POLL_SECONDS", 0.01)
    ctx = SimpleNamespace(store=RaceStore())
    sent = [chunk async for chunk in runs._stream(ctx, "run-1", 0, Connected())]
    assert any("event: run.status_changed" in chunk for chunk in sent), sent
