"""One copy of each capability snapshot for all the runs a worker holds.

A run's workflow keeps its capability snapshot (the tools with their
parameter schemas, and which seat may call which) for its whole life; built
from JSON, a small deployment's snapshot is about 15 KiB of Python objects,
and a worker caches up to a thousand runs, most of them waiting for a person
with the same snapshot as every other run (bench/README, "Memory per waiting
run"). A run keeps the copy already held for the same value instead of its
own.

"The same value" is the snapshot's values written as JSON text, each key in
its order and each number as its Python type has it, by a digest computed
here (a NaN or an infinity, which JSON cannot carry and pydantic's JSON
writes as null, is refused rather than written): never the digest a run
claims, never the store's canonical digest (its sorted keys and nulls would
join snapshots that differ in key order or NaN), and never ``==``, which
takes ``10`` and ``10.0`` for one value. A run started through Temporal with
a made-up carried state could otherwise hand honest runs a copy they would
send differently (review found both). A snapshot holding NaN or infinity is
not shared.

The table holds its copies weakly: a copy leaves it when the last run
holding it is gone, so a made-up run's snapshot, however large, lives no
longer than that run in the worker's cache, as before (review found a table
that kept them).

Why sharing across runs is safe, where workflow code shares nothing else
(tests/test_workflow_determinism.py, which also checks that this table is
the module's only state):
- The snapshot cannot be changed through the models: they are frozen, and
  the snapshot's tools, seats' grants and each grant's tools are tuples.
  What is left mutable is a tool's own lists and parameter schema, which a
  write (checked, below) and the turns of runs opened before snapshots were
  kept depend on. Nothing changes them in place (workflow code only looks
  tools and grants up); tests/test_shared_snapshots.py checks a run with a
  read and an approved write leaves the shared copy's value as it was.
- A write is never decided on this copy alone: the write's intercept checks
  the snapshot the run sends against the digest the store pinned the run
  to (activities/run_activities.py, ``pinned_snapshot``).
- No workflow code compares objects by identity (the reading test refuses
  ``id()``, ``hash()`` and ``is`` between two values neither of which is a
  singleton), so a run sees only its own value.

Called from workflow activations, which run on several threads: the table's
single reads and writes hold the GIL (a copy that dies meanwhile reads as
absent), and a race only keeps one of two copies of the same value.
"""

from __future__ import annotations

import hashlib
import json
import weakref

from roundtable.models import CapabilitySnapshot

_by_digest: weakref.WeakValueDictionary[str, CapabilitySnapshot] = weakref.WeakValueDictionary()


def value_text(snapshot: CapabilitySnapshot) -> str | None:
    """The snapshot's values as JSON text, each key in its order and each
    number as its Python type has it; None for a value JSON cannot carry as
    it is (NaN, infinity, and what only Python code can build: sets, bytes,
    lone surrogates), which is then never shared. Exact for what a run is
    given, which is always decoded from JSON; not for what only Python code
    can build (``(1, 2)`` and ``[1, 2]`` read alike). Which fields were set
    is not part of it (nothing sends or reads a snapshot by its set fields)."""
    encoded = _value_bytes(snapshot)
    return None if encoded is None else encoded.decode()


def _value_bytes(snapshot: CapabilitySnapshot) -> bytes | None:
    """:func:`value_text`, encoded (what is digested)."""
    try:
        # Python's values, not pydantic's JSON ones: those already have NaN
        # as None, alike to a real null.
        text = json.dumps(
            snapshot.model_dump(),
            separators=(",", ":"),
            ensure_ascii=False,
            allow_nan=False,
        )
        return text.encode()  # a lone surrogate cannot be: UnicodeEncodeError
    except (TypeError, ValueError):
        return None


def shared_snapshot(snapshot: CapabilitySnapshot | None) -> CapabilitySnapshot | None:
    """The copy held for ``snapshot``'s value (:func:`value_text`), or
    ``snapshot`` itself, held from now on while a run holds it."""
    if snapshot is None:
        return None
    encoded = _value_bytes(snapshot)
    if encoded is None:
        return snapshot
    digest = hashlib.sha256(encoded).hexdigest()
    kept = _by_digest.get(digest)
    if kept is not None:
        return kept
    _by_digest[digest] = snapshot
    return snapshot
