"""Capability snapshots by digest, for the seat turns that name one instead
of carrying their tool specs (TakeTurnInput.tools_of).

The store keeps each snapshot's body under its sha256 once (runs share
snapshots); a worker reads one the first time a turn names it and keeps it
while it is among the most recently named. The digest is checked against
the body read, so a row that is not what its key says never reaches a model.
"""

from __future__ import annotations

from collections import OrderedDict

from pydantic import ValidationError
from temporalio.exceptions import ApplicationError

from roundtable.models import CapabilitySnapshot, canonical_digest
from roundtable.store import Store

# A turn that names a snapshot the store does not hold (or holds in a form
# this worker cannot read) cannot be given its tools: it fails, not retried,
# rather than let the model answer without them.
SNAPSHOT_NOT_KEPT = "snapshot_not_kept"


def snapshot_digest(snapshot: CapabilitySnapshot) -> str:
    return canonical_digest(snapshot.model_dump(mode="json")) or ""


class KeptSnapshots:
    """The snapshots this worker has read or kept, the newest ``size``."""

    def __init__(self, store: Store, size: int = 256) -> None:
        self.store = store
        self.size = size
        self._known: OrderedDict[str, CapabilitySnapshot] = OrderedDict()

    def remember(self, digest: str, snapshot: CapabilitySnapshot) -> None:
        self._known[digest] = snapshot
        self._known.move_to_end(digest)
        while len(self._known) > self.size:
            self._known.popitem(last=False)

    async def get(self, digest: str) -> CapabilitySnapshot:
        known = self._known.get(digest)
        if known is not None:
            self._known.move_to_end(digest)
            return known
        body = await self.store.kept_snapshot(digest)
        if body is None:
            raise ApplicationError(
                f"no capability snapshot is kept under {digest!r}",
                type=SNAPSHOT_NOT_KEPT,
                non_retryable=True,
            )
        try:
            snapshot = CapabilitySnapshot.model_validate(body)
        except ValidationError as exc:
            raise ApplicationError(
                f"the capability snapshot kept under {digest!r} cannot be read: {exc}",
                type=SNAPSHOT_NOT_KEPT,
                non_retryable=True,
            ) from exc
        if snapshot_digest(snapshot) != digest:
            raise ApplicationError(
                f"the capability snapshot kept under {digest!r} is not the one it names",
                type=SNAPSHOT_NOT_KEPT,
                non_retryable=True,
            )
        self.remember(digest, snapshot)
        return snapshot
