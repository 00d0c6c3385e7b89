"""The event streams' keep-alive: a comment after a quiet spell, none while
events flow, and the quiet count starts again after each."""

from __future__ import annotations

from api.keepalive import KEEP_ALIVE, KeepAlive


def test_a_keep_alive_after_a_quiet_spell_and_none_while_events_flow() -> None:
    keep = KeepAlive(poll_seconds=1.0, every_seconds=3.0)
    assert [keep.after_poll(sent=False) for _ in range(3)] == [None, None, KEEP_ALIVE]
    assert [keep.after_poll(sent=False) for _ in range(3)] == [None, None, KEEP_ALIVE]
    keep.after_poll(sent=False)
    keep.after_poll(sent=False)
    assert keep.after_poll(sent=True) is None  # an event resets the quiet spell
    assert [keep.after_poll(sent=False) for _ in range(3)] == [None, None, KEEP_ALIVE]
