"""One copy of each capability snapshot for all the runs a worker holds.

A run's workflow keeps its capability snapshot (the tools with their
parameter schemas, and which seat may call which) for its whole life; built
from JSON, a small deployment's snapshot is about 15 KiB of Python objects,
and a worker caches up to a thousand runs, most of them waiting for a person
with the same snapshot as every other run (bench/README, "Memory per waiting
run"). The run keeps the copy already held for the same digest instead of
its own.

Why sharing across runs is safe here, where workflow code shares nothing
else (tests/test_workflow_determinism.py): the snapshot's models are frozen
and nothing changes their lists or schemas in place; two snapshots are
shared only when equal, so a run sees the value it was given, only not its
own object; and what a write may do is never decided on this copy alone: the
write's intercept checks the snapshot the run sends against the digest the
store pinned the run to (activities/run_activities.py, ``pinned_snapshot``),
so a copy changed by mistake would be refused, not obeyed.

Called from workflow activations, which run on several threads: the table is
a plain dict, whose single reads and writes hold the GIL, and a race only
keeps one of two equal copies.
"""

from __future__ import annotations

from roundtable.models import CapabilitySnapshot

# Distinct snapshots kept (a worker serves few tool sets); past it the table
# starts afresh, and runs keep whichever copy they already hold.
KEPT = 64
_by_digest: dict[str, CapabilitySnapshot] = {}


def shared_snapshot(
    digest: str | None, snapshot: CapabilitySnapshot | None
) -> CapabilitySnapshot | None:
    """The copy kept for ``digest`` when it equals ``snapshot``; otherwise
    ``snapshot``, kept from now on. Without a digest (runs opened before
    snapshots were kept) the run keeps its own."""
    if digest is None or snapshot is None:
        return snapshot
    kept = _by_digest.get(digest)
    if kept is not None and kept == snapshot:
        return kept
    if len(_by_digest) >= KEPT:
        _by_digest.clear()
    _by_digest[digest] = snapshot
    return snapshot
