"""Capability snapshots by digest, for the seat turns that name one instead
of carrying their tool specs (TakeTurnInput.tools_of).

The store keeps each snapshot once (runs share snapshots), as the very JSON
text its digest is taken of; a worker reads one the first time a turn names
it and keeps it while it is among the most recently named. The text read is
checked against the digest, so a row that is not what its key says never
reaches a model.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from pydantic import ValidationError
from temporalio.exceptions import ApplicationError

from roundtable.models import CapabilitySnapshot, canonical_digest
from roundtable.store import Store

# A turn that names a snapshot the store does not hold (or holds other than
# its digest says) cannot be given its tools: it fails, not retried, rather
# than let the model answer without them.
SNAPSHOT_NOT_KEPT = "snapshot_not_kept"
# One that is kept but not readable by this worker: retried elsewhere.
SNAPSHOT_NOT_READABLE_HERE = "snapshot_not_readable_here"


def snapshot_digest(snapshot: CapabilitySnapshot) -> str:
    return canonical_digest(snapshot.model_dump(mode="json")) or ""


def kept_text(snapshot: CapabilitySnapshot) -> str:
    """The snapshot as the store keeps it: canonical JSON (sorted keys, no
    spaces), the values :func:`snapshot_digest` digests, read back exactly.
    ASCII, so text columns take it whatever a tool's description holds."""
    return kept_form(snapshot)[1]


def kept_form(snapshot: CapabilitySnapshot) -> tuple[str, str]:
    """Its digest and its kept text, from one dump (a run's opening needs both)."""
    value = snapshot.model_dump(mode="json")
    return canonical_digest(value) or "", json.dumps(value, sort_keys=True, separators=(",", ":"))


class KeptSnapshots:
    """The snapshots this worker has read or kept: the most recently named,
    at most ``count`` of them and ``size`` characters of their JSON."""

    def __init__(self, store: Store, count: int = 256, size: int = 16 * 1024 * 1024) -> None:
        self.store = store
        self.count, self.size = count, size
        self._known: OrderedDict[str, tuple[CapabilitySnapshot, int]] = OrderedDict()
        self._held = 0

    def remember(self, digest: str, snapshot: CapabilitySnapshot, size: int) -> None:
        """``size``: the length of its kept text (the bound's measure)."""
        if digest in self._known:
            self._known.move_to_end(digest)
            return
        self._known[digest] = (snapshot, size)
        self._held += size
        while len(self._known) > self.count or (self._held > self.size and len(self._known) > 1):
            _, (_, dropped) = self._known.popitem(last=False)
            self._held -= dropped

    async def get(self, digest: str) -> CapabilitySnapshot:
        known = self._known.get(digest)
        if known is not None:
            self._known.move_to_end(digest)
            return known[0]
        text = await self.store.kept_snapshot(digest)
        if text is None:
            raise _not_kept(f"no capability snapshot is kept under {digest!r}")
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise _not_kept(f"the snapshot kept under {digest!r} is not JSON: {exc}") from exc
        # The digest of the values as kept, not of a model made of them: a
        # row written before a field was added to the models (with a
        # default) still matches when a newer worker reads it.
        if canonical_digest(value) != digest:
            raise _not_kept(
                f"the capability snapshot kept under {digest!r} is not the one it names"
            )
        try:
            snapshot = CapabilitySnapshot.model_validate(value)
        except ValidationError as exc:
            # What it names is there, in a form this worker does not know: a
            # newer release's (a field added since), during a rolling deploy.
            # Retried, so a worker that knows it takes the turn (review).
            raise ApplicationError(
                f"the snapshot kept under {digest!r} is in a form this worker cannot read: {exc}",
                type=SNAPSHOT_NOT_READABLE_HERE,
            ) from exc
        self.remember(digest, snapshot, len(text))
        return snapshot


def _not_kept(message: str) -> ApplicationError:
    return ApplicationError(message, type=SNAPSHOT_NOT_KEPT, non_retryable=True)
