"""What every request needs: the store, a Temporal client, the settings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from temporalio.client import Client

from roundtable.config import Settings
from roundtable.operations import TemporalUnavailableError
from roundtable.permissions import Authority
from roundtable.store import Store
from roundtable.temporal import TemporalSettingsError, connect


@dataclass
class ApiContext:
    settings: Settings
    store: Store
    client: Client | None = None
    tracing: bool = False  # the Temporal client this connects traces its calls
    _connecting: asyncio.Lock = field(default_factory=asyncio.Lock)
    authority: Authority = field(init=False)

    def __post_init__(self) -> None:
        self.authority = Authority.from_settings(self.settings)

    async def temporal(self) -> Client:
        """Connect on first use, so the API serves reads while Temporal is down."""
        async with self._connecting:
            if self.client is None:
                try:
                    self.client = await connect(self.settings, tracing=self.tracing)
                except TemporalSettingsError as exc:  # a certificate file gone since start-up
                    raise TemporalUnavailableError(f"cannot connect to Temporal: {exc}") from None
                except Exception as exc:
                    raise TemporalUnavailableError(
                        f"cannot reach Temporal at {self.settings.temporal_address}"
                    ) from exc
            return self.client


def context(request: Request) -> ApiContext:
    return request.app.state.context
