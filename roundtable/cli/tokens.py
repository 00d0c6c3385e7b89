"""``roundtable tokens``: API bearer tokens. A new token is printed once."""

from __future__ import annotations

from typing import Annotated

import typer

from roundtable.cli.output import emit, run_or_fail, table
from roundtable.cli.shared import JsonFlag, settings, store_from

app = typer.Typer(no_args_is_help=True, help="API bearer tokens.")


@app.command("create")
def create(
    user: Annotated[str, typer.Option("--user", help="Whose token.")],
    role: Annotated[
        str, typer.Option("--role", help="user, operator, service or codec (encode/decode only).")
    ],
    label: Annotated[str | None, typer.Option(help="A note to tell tokens apart.")] = None,
    tenants: Annotated[
        str | None,
        typer.Option(help="User tokens: comma-separated tenants it may act for (default: all)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Create a token; it is shown now and never again (only its hash is kept)."""
    limited = None if tenants is None else tenants.split(",")

    async def make() -> tuple[str, dict]:
        async with store_from(settings()) as store:
            return await store.create_token(user_id=user, role=role, label=label, tenants=limited)

    token, record = run_or_fail(make(), as_json)
    emit(
        {
            "token": token,
            "id": record["id"],
            "user_id": user,
            "role": role,
            "tenants": record["tenants"],
        },
        as_json,
        f"{token}\n(id {record['id']}; store it now: it cannot be shown again)",
    )


@app.command("list")
def list_tokens(as_json: JsonFlag = False) -> None:
    """List tokens (without their secrets)."""

    async def read() -> list[dict]:
        async with store_from(settings()) as store:
            return await store.list_tokens()

    rows = run_or_fail(read(), as_json)
    emit(
        rows,
        as_json,
        table(
            rows,
            [
                "id",
                "token_prefix",
                "user_id",
                "role",
                "tenants",
                "label",
                "created_at",
                "revoked_at",
            ],
        ),
    )


@app.command("revoke")
def revoke(
    token_id: Annotated[str, typer.Argument(help="Token id (from tokens list).")],
    as_json: JsonFlag = False,
) -> None:
    """Revoke a token for good."""

    async def drop() -> dict:
        async with store_from(settings()) as store:
            return await store.revoke_token(token_id)

    record = run_or_fail(drop(), as_json)
    emit(record, as_json, f"token {token_id} revoked")
