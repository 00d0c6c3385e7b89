"""Log lines: readable by default, one JSON object a line with
``ROUNDTABLE_LOG_FORMAT=json``, carrying ``run_id``, ``action_id`` and
``approval_id`` where they apply.

Ids come from two places: inside an activity of a run, the run is the
activity's workflow; activities that act on one action or approval
:func:`bind` its id for the rest of their task (an activity runs in a task of
its own, so a bound id never leaks into another).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from roundtable.names import RUN_WORKFLOW

_IDS = ("run_id", "action_id", "approval_id")
_bound: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("roundtable_log_ids")
OUR_LOGGERS = ("roundtable",)
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s%(ids)s"


def bind(**ids: str | None) -> None:
    """Name what the current task acts on, for every line it logs from now on."""
    _bound.set({**_bound.get({}), **{k: v for k, v in ids.items() if v}})


def current_ids() -> dict[str, str]:
    ids = dict(_bound.get({}))
    if activity.in_activity():
        info = activity.info()
        if info.workflow_type == RUN_WORKFLOW:
            ids.setdefault("run_id", info.workflow_id or "")
    return {k: v for k, v in ids.items() if k in _IDS and v}


class WithIds(logging.Filter):
    """Adds the ids to every record (``record.ids`` rendered for the plain format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = {**current_ids(), **{k: getattr(record, k) for k in _IDS if hasattr(record, k)}}
        record.roundtable_ids = ids
        record.ids = "".join(f" {k}={v}" for k, v in ids.items())
        return True


class JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "roundtable_ids", {}),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def handler(log_format: str | None = None, stream: Any = None) -> logging.Handler:
    """A handler in ``log_format`` (default: ROUNDTABLE_LOG_FORMAT, else plain)."""
    chosen = (log_format or os.environ.get("ROUNDTABLE_LOG_FORMAT") or "plain").strip().lower()
    if chosen not in ("plain", "json"):
        raise ValueError(f"ROUNDTABLE_LOG_FORMAT must be plain or json, not {chosen!r}")
    made = logging.StreamHandler(stream or sys.stderr)
    made.addFilter(WithIds())
    made.setFormatter(JsonLines() if chosen == "json" else logging.Formatter(PLAIN_FORMAT))
    return made


def configure_logging(level: int = logging.INFO, ours: int | None = None) -> None:
    """The process's logging: everything at ``level``; Roundtable's own
    loggers at ``ours`` when given (``roundtable dev`` shows our informational
    lines, the libraries' warnings only)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler())
    root.setLevel(level)
    if ours is not None:
        for name in OUR_LOGGERS:
            logging.getLogger(name).setLevel(ours)
