"""Webhooks a run sends as things happen: started at once, never waited on
until the run ends or continues as new."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.webhook_activities import WebhookActivities
    from roundtable.models import RunState, WebhookDelivery, WebhookEvent

from workflows.timeouts import WEBHOOK_RETRIES


class Notifier:
    def __init__(self, state: RunState) -> None:
        self.state = state
        self._deliveries: list = []  # webhook activities still under way

    def notify(self, event_type: str, subject: str, data: dict) -> None:
        """Start delivering a webhook to each receiver; the run does not wait."""
        event = WebhookEvent(
            event_id=f"{self.state.run_id}:{event_type}:{subject}",
            event_type=event_type,
            run_id=self.state.run_id,
            occurred_at=workflow.now(),
            data=data,
        )
        for url in self.state.webhook_urls:
            self._deliveries.append(
                workflow.start_activity_method(
                    WebhookActivities.deliver_webhook,
                    WebhookDelivery(event=event, url=url),
                    start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=WEBHOOK_RETRIES,
                    summary=f"webhook {event_type}",
                )
            )

    async def done(self) -> None:
        """Let deliveries finish (or give up) before the run ends or continues
        as new; a receiver that is down never fails the run."""
        pending, self._deliveries = self._deliveries, []
        await asyncio.gather(*pending, return_exceptions=True)
