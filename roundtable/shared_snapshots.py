"""One copy of each capability snapshot for all the runs a worker holds.

A run's workflow keeps its capability snapshot (the tools with their
parameter schemas, and which seat may call which) for its whole life; built
from JSON, a small deployment's snapshot is about 15 KiB of Python objects,
and a worker caches up to a thousand runs, most of them waiting for a person
with the same snapshot as every other run (bench/README, "Memory per waiting
run"). A run keeps the copy already held for the same value instead of its
own.

"The same value" is the snapshot's canonical JSON, by its digest computed
here (``canonical_digest``, as the store pins a run to it), never the digest
a run claims and never ``==``: Python's equality takes ``10`` and ``10.0``
(or ``0.0`` and ``-0.0``) for one value where the JSON, and so the pinned
digest, tells them apart, so a run started with a made-up state could
otherwise have planted a copy that every honest run then took and whose
writes the store refused (found by review). The table's key is always the
digest of the copy it holds.

Why sharing across runs is safe, where workflow code shares nothing else
(tests/test_workflow_determinism.py, which also checks that this table is
the module's only state):
- The snapshot cannot be changed through the models: they are frozen, and
  the snapshot's tools, seats' grants and each grant's tools are tuples.
  What is left mutable is a tool's own lists and parameter schema, which
  only a write depends on.
- A write is never decided on this copy alone: the write's intercept checks
  the snapshot the run sends against the digest the store pinned the run
  to (activities/run_activities.py, ``pinned_snapshot``).
- No workflow code compares objects by identity (the reading test refuses
  ``id()`` and ``hash()``), so a run sees only its own value.

Called from workflow activations, which run on several threads: the table is
a plain dict, whose single reads and writes hold the GIL, and a race only
keeps one of two copies of the same value.
"""

from __future__ import annotations

from roundtable.models import CapabilitySnapshot, canonical_digest

# Distinct snapshots kept: one per tool set and seat list in use (the seats'
# grants are part of the value). Past it the table starts afresh, and runs
# keep whichever copy they already hold.
KEPT = 256
_by_digest: dict[str, CapabilitySnapshot] = {}


def shared_snapshot(snapshot: CapabilitySnapshot | None) -> CapabilitySnapshot | None:
    """The copy kept for ``snapshot``'s value, or ``snapshot`` itself, kept
    from now on."""
    if snapshot is None:
        return None
    digest = canonical_digest(snapshot.model_dump(mode="json"))
    assert digest is not None  # a snapshot's dump is an object, never None
    kept = _by_digest.get(digest)
    if kept is not None:
        return kept
    if len(_by_digest) >= KEPT:
        _by_digest.clear()
    _by_digest[digest] = snapshot
    return snapshot
