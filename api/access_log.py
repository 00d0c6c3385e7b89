"""Keep credentials out of access logs.

The Temporal UI can only reach the codec through a URL, so its codec token
travels in the path (``/codec/t/<token>/decode``); uvicorn's access log would
print it on every request.
"""

from __future__ import annotations

import logging
import re

_TOKEN_IN_PATH = re.compile(r"(/codec/t/)[^/?\s]+")


def redact_path(path: str) -> str:
    return _TOKEN_IN_PATH.sub(r"\1[redacted]", path)


class RedactTokenPaths(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact_path(arg) if isinstance(arg, str) else arg for arg in record.args
            )
        elif isinstance(record.msg, str):
            record.msg = redact_path(record.msg)
        return True


def install() -> None:
    """Add the filter to uvicorn's access logger (once)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactTokenPaths) for f in access.filters):
        access.addFilter(RedactTokenPaths())
