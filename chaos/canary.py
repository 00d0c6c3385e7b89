"""Section 5: the canary planted in tool arguments must appear nowhere but in
the encrypted columns (and in the ticket system itself, the outside world the
comment was written to). Each place is scanned and every hit reported."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from sqlalchemy import inspect, select, table, text
from temporalio.client import Client

from roundtable.store.engine import create_engine_for

# Where the canary may be: ciphertext columns, and the demo ticket system's
# own tickets (the comment really was written there: that is the tool's job).
ALLOWED_COLUMNS = frozenset(
    {
        ("action_secrets", "arguments_encrypted"),
        ("tool_results", "content_encrypted"),
    }
)
OUTSIDE_WORLD_TABLES = frozenset({"demo_tickets"})


async def scan_database(url: str, canary: str) -> list[str]:
    engine = create_engine_for(url)
    leaks = []
    try:
        async with engine.connect() as conn:
            names = await conn.run_sync(lambda sync: inspect(sync).get_table_names())
            for name in sorted(set(names) - OUTSIDE_WORLD_TABLES):
                columns = await conn.run_sync(
                    lambda sync, n=name: [c["name"] for c in inspect(sync).get_columns(n)]
                )
                rows = (await conn.execute(select(text("*")).select_from(table(name)))).all()
                for row in rows:
                    for column, value in zip(columns, row, strict=False):
                        if (name, column) not in ALLOWED_COLUMNS and canary in str(value):
                            leaks.append(f"database {name}.{column}")
    finally:
        await engine.dispose()
    return sorted(set(leaks))


async def planted(url: str, canary: str) -> int:
    """Tickets whose comments or fields carry the canary: proof it was planted
    and reached the tool (otherwise finding it nowhere would prove nothing)."""
    engine = create_engine_for(url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(select(text("*")).select_from(table("demo_tickets")))).all()
    finally:
        await engine.dispose()
    return sum(1 for row in rows if canary in str(tuple(row)))


def scan_files(paths: list[Path], canary: str, what: str) -> list[str]:
    needle = canary.encode()
    return [
        f"{what} {path.name}" for path in paths if path.exists() and needle in path.read_bytes()
    ]


async def scan_temporal(address: str, canary: str) -> tuple[int, list[str]]:
    """Raw history (a client without the codec): payloads as stored, failure
    messages included. Returns (histories read, leaks)."""
    client = await Client.connect(address)  # the default converter: no decryption
    leaks, read = [], 0
    async for execution in client.list_workflows():
        history = await client.get_workflow_handle(
            execution.id, run_id=execution.run_id
        ).fetch_history()
        read += 1
        if canary in history.to_json():
            leaks.append(f"temporal history {execution.id}")
    return read, leaks


class WebhookSink:
    """A webhook receiver that keeps every body it is sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with sink.path.open("ab") as out:
                    out.write(body + b"\n")
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def count(self) -> int:
        return len(self.path.read_bytes().splitlines()) if self.path.exists() else 0

    @contextlib.contextmanager
    def running(self) -> Iterator[WebhookSink]:
        self.thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()
