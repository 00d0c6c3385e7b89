"""Ending a process that used the Temporal SDK."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """Exit with ``code`` now, without interpreter finalization: the SDK's
    native threads can outlive the event loop, and CPython then aborts with
    "PyGILState_Release ... finalizing" (temporalio/sdk-python#300), turning
    a finished command into exit 134 about 1 time in 40 here. Callers have
    closed their stores and clients by now; logs and output are flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
