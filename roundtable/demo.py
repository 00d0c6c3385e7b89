"""The demo run `make run` starts: two seats, two writes to one ticket, a read."""

from __future__ import annotations

from roundtable.models import RunInput, ScriptDocument

DEMO_TICKET = {"tenant_id": "acme", "ticket_id": "T-100"}

DEMO_SCRIPT = ScriptDocument.model_validate(
    {
        "turns": [
            {
                "seat": "seat-1",
                "round": 1,
                "text": "The customer is blocked; I will raise the priority.",
                "tool_calls": [
                    {"name": "ticket_get", "args": DEMO_TICKET},
                    {
                        "name": "ticket_update",
                        "args": {**DEMO_TICKET, "fields": {"priority": "P1"}},
                    },
                ],
            },
            {
                "seat": "seat-2",
                "round": 1,
                "text": "I will tell the customer we are on it.",
                "tool_calls": [
                    {
                        "name": "ticket_comment",
                        "args": {**DEMO_TICKET, "body": "We are on it; update within the hour."},
                    },
                ],
            },
        ],
        "final": "Ticket T-100 was raised to P1 and the customer was told.",
    }
)


def demo_request(run_id: str) -> RunInput:
    # Parallel, so both writes wait for approval at once and then meet at the
    # ticket's lease: one runs, the other waits its turn.
    return RunInput(
        run_id=run_id,
        task_text="Triage ticket acme/T-100: the customer cannot log in.",
        seats=["seat-1", "seat-2"],
        mode="parallel",
        script=DEMO_SCRIPT,
        user_id="demo-user",
    )
