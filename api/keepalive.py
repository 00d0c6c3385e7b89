"""The keep-alive of a polled server-sent stream: a comment line after a
quiet spell, so proxies and browsers do not drop an idle connection."""

from __future__ import annotations

KEEP_ALIVE = ": keep-alive\n\n"


class KeepAlive:
    def __init__(self, poll_seconds: float, every_seconds: float) -> None:
        self._poll, self._every, self._quiet = poll_seconds, every_seconds, 0.0

    def after_poll(self, sent: bool) -> str | None:
        """Call once a poll: the keep-alive line to send now, if any."""
        if sent:
            self._quiet = 0.0
            return None
        self._quiet += self._poll
        if self._quiet < self._every:
            return None
        self._quiet = 0.0
        return KEEP_ALIVE
