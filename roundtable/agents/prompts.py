"""How a seat or the manager is addressed. Prompts live with the adapters,
not in the workflow, so orchestration stays free of wording."""

from __future__ import annotations

from roundtable.models import ChatMessage


def seat_system_prompt(seat: str, task_text: str, role: str | None = None) -> ChatMessage:
    persona = f" Your role: {role}." if role else ""
    return ChatMessage(
        role="system",
        content=(
            f"You are {seat}, one seat at a roundtable working on a task with other agents."
            f"{persona} Speak briefly. You may call tools; writes are reviewed before they run, "
            "and you will be told each write's outcome.\n\nTask: " + task_text
        ),
    )


def round_prompt(round_number: int, others: list[ChatMessage]) -> ChatMessage:
    lines = [f"Round {round_number}."]
    if others:
        lines.append("Since your last turn:")
        lines.extend(f"- {m.name or m.role}: {m.content}" for m in others)
    lines.append("Your contribution?")
    return ChatMessage(role="user", content="\n".join(lines))


def manager_messages(task_text: str, transcript: list[ChatMessage]) -> list[ChatMessage]:
    body = "\n".join(f"{m.name or m.role}: {m.content}" for m in transcript)
    return [
        ChatMessage(
            role="system",
            content="You chair a roundtable. Write the final answer to the task from the "
            "discussion.\n\nTask: " + task_text,
        ),
        ChatMessage(role="user", content="The discussion:\n" + body),
    ]
