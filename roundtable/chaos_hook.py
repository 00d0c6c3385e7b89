"""Test-only database fault injection for the chaos harness (``chaos/``).

Production never enables this: it does nothing unless ``ROUNDTABLE_CHAOS=1``
is set as well as a fault spec. The spec names injection points and a
probability each, ``record_result:0.2,renew:0.2``, either directly in
``ROUNDTABLE_CHAOS_DB_FAULTS`` or in the file ``ROUNDTABLE_CHAOS_DB_FAULTS_FILE``
names (re-read on every call, so the harness can arm and disarm a window while
the worker runs). An injected failure raises a database-like error inside the
store's transaction, before commit, so the transaction rolls back exactly as
if the database had failed there; each one is logged, which is how the
harness counts what was really injected.
"""

from __future__ import annotations

import logging
import os
import random

from sqlalchemy.exc import OperationalError

log = logging.getLogger("roundtable.chaos")
POINTS = frozenset({"record_result", "renew"})
_random = random.Random()  # noqa: S311 (fault timing, not security)


class InjectedDatabaseFault(OperationalError):
    """What an armed injection point raises: a database error, as the store sees one."""


def _spec() -> str:
    path = os.environ.get("ROUNDTABLE_CHAOS_DB_FAULTS_FILE")
    if path:
        try:
            with open(path) as armed:
                return armed.read()
        except OSError:
            return ""
    return os.environ.get("ROUNDTABLE_CHAOS_DB_FAULTS", "")


def rates(spec: str) -> dict[str, float]:
    """``"record_result:0.2,renew:0.1"`` → ``{"record_result": 0.2, "renew": 0.1}``;
    unknown points and malformed entries are ignored."""
    found: dict[str, float] = {}
    for entry in spec.replace("\n", ",").split(","):
        point, _, rate = entry.strip().partition(":")
        if point in POINTS:
            try:
                found[point] = min(max(float(rate), 0.0), 1.0)
            except ValueError:
                continue
    return found


def maybe_fail(point: str) -> None:
    """Raise :class:`InjectedDatabaseFault` at ``point`` with its armed
    probability; a no-op unless ROUNDTABLE_CHAOS=1."""
    if os.environ.get("ROUNDTABLE_CHAOS") != "1":
        return
    rate = rates(_spec()).get(point, 0.0)
    if rate and _random.random() < rate:
        log.warning("chaos: injected database failure at %s", point)
        raise InjectedDatabaseFault(
            f"chaos: injected failure at {point}", params=None, orig=ConnectionError(point)
        )
