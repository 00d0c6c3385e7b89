"""Webhook delivery: one activity per event and receiver, retried with backoff
by Temporal; every attempt goes to the delivery log."""

from __future__ import annotations

import httpx
from temporalio import activity
from temporalio.exceptions import ApplicationError

from roundtable.models import WebhookDelivery
from roundtable.names import WEBHOOK_REJECTED
from roundtable.store import Store
from roundtable.webhooks import SIGNATURE_HEADER, body_of, receiver_label, sign

FAILED = "WebhookFailed"  # transient: retried with backoff


class WebhookActivities:
    def __init__(
        self,
        store: Store,
        signing_key: bytes,
        timeout_seconds: float = 10,
        urls: list[str] | None = None,
    ) -> None:
        self.store = store
        self.signing_key = signing_key
        self.timeout_seconds = timeout_seconds
        # Workflows name receivers by label (their URLs, which may carry a
        # secret, never enter a history); runs from before named them by URL.
        # Either way only a configured receiver is ever called.
        self.receivers = {receiver_label(u): u for u in urls or []} | {u: u for u in urls or []}

    @activity.defn(name="deliver_webhook")
    async def deliver_webhook(self, delivery: WebhookDelivery) -> int:
        url = self.receivers.get(delivery.url)
        if url is None:
            raise ApplicationError(
                "not a receiver this worker is configured for",
                type=WEBHOOK_REJECTED,
                non_retryable=True,
            )
        delivery = delivery.model_copy(update={"url": url})
        event = delivery.event.model_dump(mode="json")
        body = body_of(event)
        headers = {
            "Content-Type": "application/json",
            "X-Roundtable-Event": delivery.event.event_type,
            "X-Roundtable-Delivery": delivery.event.event_id,
            SIGNATURE_HEADER: sign(self.signing_key, body),
        }
        log = {
            "delivery_id": delivery.event.event_id,
            "run_id": delivery.event.run_id,
            "event_type": delivery.event.event_type,
            "url": receiver_label(delivery.url),
            "attempt": activity.info().attempt,
        }
        try:
            async with httpx.AsyncClient(timeout=self.timeout_seconds) as http:
                response = await http.post(delivery.url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            await self.store.record_webhook_attempt(
                **log, status_code=None, error=type(exc).__name__, delivered=False
            )
            # Retried with backoff. Not httpx's own message: it may quote the URL.
            raise ApplicationError(
                f"{type(exc).__name__} reaching {log['url']}", type=FAILED
            ) from None
        delivered = 200 <= response.status_code < 300
        await self.store.record_webhook_attempt(
            **log,
            status_code=response.status_code,
            error=None if delivered else response.text[:500],
            delivered=delivered,
        )
        if delivered:
            return response.status_code
        # A 4xx (but 408 and 429) says the request itself is wrong: trying again
        # cannot help. Anything else may pass later. The types differ so the
        # workflow's retry policy can tell them apart.
        permanent = 400 <= response.status_code < 500 and response.status_code not in (408, 429)
        raise ApplicationError(
            f"{log['url']} answered {response.status_code}",
            type=WEBHOOK_REJECTED if permanent else FAILED,
            non_retryable=permanent,
        )
