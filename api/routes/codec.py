"""The Temporal codec-server endpoints, so an SRE can read payloads in the UI.

Same wire format as Temporal's codec servers: ``{"payloads": [<Payload as
proto-JSON>]}`` in and out. Decoding reveals everything a run carries, so
only operator tokens and the codec credential (role ``codec``, which can do
nothing else) may use it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from temporalio.api.common.v1 import Payloads

from api.auth import CodecCaller, Context, Principal, authenticated, require_codec_role
from api.problems import Problem
from roundtable.codec import EncryptionCodec, PayloadKeyError

router = APIRouter(prefix="/codec", tags=["codec"])


async def _payloads(request: Request, caller: Principal) -> Payloads:
    require_codec_role(caller)
    try:
        return ParseDict(await request.json(), Payloads())
    except (ParseError, ValueError, TypeError) as exc:
        raise Problem(
            422,
            "validation_error",
            f"payloads: {exc}",
            errors=[{"field": "payloads", "message": str(exc)}],
        ) from exc


def _codec(request: Request) -> EncryptionCodec:
    return request.app.state.codec


async def _encode(request: Request, caller: Principal) -> dict[str, Any]:
    payloads = await _payloads(request, caller)
    encoded = await _codec(request).encode(list(payloads.payloads))
    return MessageToDict(Payloads(payloads=encoded))


async def _decode(request: Request, caller: Principal) -> dict[str, Any]:
    payloads = await _payloads(request, caller)
    try:
        decoded = await _codec(request).decode(list(payloads.payloads))
    except PayloadKeyError as exc:
        raise Problem(422, "undecodable_payload", str(exc)) from exc
    return MessageToDict(Payloads(payloads=decoded))


@router.post("/encode")
async def encode(request: Request, caller: CodecCaller) -> dict[str, Any]:
    return await _encode(request, caller)


@router.post("/decode")
async def decode(request: Request, caller: CodecCaller) -> dict[str, Any]:
    return await _decode(request, caller)


# The Temporal UI posts to "<codec endpoint>/decode" and cannot add a bearer
# header, so its endpoint carries a codec token in the path instead:
# --ui-codec-endpoint http://api/codec/t/<codec token>. Only a codec token is
# taken there: it can do nothing but encode and decode, and an operator token
# must never end up in a URL (UI settings, process lists, access logs).
async def _path_caller(token: str, ctx: Context) -> Principal:
    caller = await authenticated(token, ctx)
    if caller.role != "codec":
        raise Problem(403, "forbidden", "only a codec token may be put in the codec path")
    return caller


@router.post("/t/{token}/encode", include_in_schema=False)
async def encode_for_ui(token: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _encode(request, await _path_caller(token, ctx))


@router.post("/t/{token}/decode", include_in_schema=False)
async def decode_for_ui(token: str, request: Request, ctx: Context) -> dict[str, Any]:
    return await _decode(request, await _path_caller(token, ctx))
