"""OpenAI-compatible chat completions: OpenAI, Azure, vLLM, Ollama, llama.cpp.

A seat's model is written ``openai:<model-name>``. The ``openai`` SDK reads
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``, and retries 429/5xx with backoff
itself; what is still failing after that fails the activity, which Temporal
retries (a 4xx other than 408/429 is final: retrying cannot fix it).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import openai
from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from roundtable.models import ChatMessage, TokenUsage, ToolCall, ToolSpec, TurnRequest, TurnResponse

PREFIX = "openai:"
MODEL_REJECTED = "ModelRequestRejected"
MODEL_UNAVAILABLE = "ModelUnavailable"
_FINAL_STATUSES = (400, 401, 403, 404, 422)
log = logging.getLogger("roundtable.model")


def _wire_message(message: ChatMessage) -> dict[str, Any]:
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        wire["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool":
        wire["tool_call_id"] = message.tool_call_id
    return wire


def _wire_tool(tool: ToolSpec) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters or {"type": "object", "properties": {}},
        },
    }


def _read_call(raw: Any) -> ToolCall:
    """A tool call as the model wrote it; unreadable arguments are kept as a
    malformed call so the seat can be told, rather than guessed at."""
    name = raw.function.name or ""
    try:
        arguments = json.loads(raw.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        return ToolCall(id=raw.id, name=name, malformed=f"arguments are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return ToolCall(id=raw.id, name=name, malformed="arguments must be a JSON object")
    return ToolCall(id=raw.id, name=name, arguments=arguments)


class OpenAIChatModel:
    def __init__(
        self,
        client: openai.AsyncOpenAI | None = None,
        timeout_seconds: float | None = None,
        max_retries: int = 2,
    ) -> None:
        self._client = client
        self.timeout_seconds = timeout_seconds or float(
            os.environ.get("ROUNDTABLE_OPENAI_TIMEOUT_SECONDS", "60")
        )
        self.max_retries = max_retries

    def _new_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            api_key=os.environ.get("OPENAI_API_KEY") or "not-needed-for-local-servers",
            timeout=self.timeout_seconds,
            max_retries=self.max_retries,
        )

    async def respond(self, request: TurnRequest) -> TurnResponse:
        # A client given is the giver's to close. One made here serves this
        # turn only and is closed with it: left open, the garbage collector
        # closed it later on whichever event loop then ran, failing on this
        # loop's transport once this loop had closed (a traceback in an
        # unrelated log), and its connections stayed open until then.
        client = self._client or self._new_client()
        try:
            return await self._respond(client, request)
        finally:
            if client is not self._client:
                await client.close()

    async def _respond(self, client: openai.AsyncOpenAI, request: TurnRequest) -> TurnResponse:
        extra: dict[str, Any] = {}
        if request.tools:
            extra["tools"] = [_wire_tool(t) for t in request.tools]
        if request.reasoning_effort:
            extra["reasoning_effort"] = request.reasoning_effort
        try:
            completion = await client.chat.completions.create(
                model=request.model.removeprefix(PREFIX),
                messages=[_wire_message(m) for m in request.messages],
                **extra,
            )
        except openai.APIStatusError as exc:
            if exc.status_code in _FINAL_STATUSES:
                raise ApplicationError(
                    f"the model endpoint refused the request ({exc.status_code})",
                    type=MODEL_REJECTED,
                    non_retryable=True,
                ) from exc
            # 408, 409, 429, 5xx: Temporal retries the turn.
            raise _will_retry(f"answered {exc.status_code}") from exc
        except openai.APIConnectionError as exc:  # timeouts included
            raise _will_retry(f"unreachable ({type(exc).__name__})") from exc
        message = completion.choices[0].message
        usage = completion.usage
        return TurnResponse(
            text=message.content or "",
            tool_calls=[_read_call(c) for c in message.tool_calls or []],
            usage=TokenUsage(
                prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
            )
            if usage
            else None,
        )


def _will_retry(what: str) -> ApplicationError:
    """A transient model failure: one line in the log (not a traceback per
    attempt), and a retryable failure Temporal retries by the turn's policy."""
    attempt = activity.info().attempt if activity.in_activity() else 1
    log.warning("model endpoint %s; attempt %d, the turn is retried", what, attempt)
    return ApplicationError(
        f"the model endpoint {what}",
        type=MODEL_UNAVAILABLE,
        category=ApplicationErrorCategory.BENIGN,
    )
