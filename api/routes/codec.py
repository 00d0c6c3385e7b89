"""The Temporal codec-server endpoints, so an SRE can read payloads in the UI.

Same wire format as Temporal's codec servers: ``{"payloads": [<Payload as
proto-JSON>]}`` in and out. Decoding reveals everything a run carries, so
only operator tokens and the codec credential (role ``codec``, which can do
nothing else) may use it.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from temporalio.api.common.v1 import Payloads

from api.auth import CodecCaller, Context, Principal, authenticated, require_codec_role
from api.openapi import AUTHENTICATED, problems
from api.peer import peer_uid, socket_owners_listed
from api.problems import Problem
from api.schemas import Payloads as PayloadsDocument
from api.schemas import PayloadsIn
from roundtable.codec import EncryptionCodec, PayloadKeyError

router = APIRouter(prefix="/codec", tags=["codec"])
# The body is read by hand (protobuf parses it), so it is declared here.
_CODEC_DOC: dict[str, Any] = {
    "response_model": PayloadsDocument,
    "responses": problems(401, 403, 413, 422),
    "dependencies": AUTHENTICATED,
    "openapi_extra": {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": PayloadsIn.model_json_schema(
                        ref_template="#/components/schemas/{model}"
                    )
                }
            },
        }
    },
}


# Payloads are a list of flat objects: a few levels. Deeper documents are
# refused before parsing, because Python's JSON parser (and protobuf's) recurse
# and a 1,000-deep document raised RecursionError, a 500.
MAX_JSON_DEPTH = 32


def _too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Nesting depth of a JSON text over ``limit``, brackets in strings ignored."""
    depth, in_string, escaped = 0, False, False
    for byte in raw:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def _invalid(message: str) -> Problem:
    return Problem(
        422,
        "validation_error",
        f"payloads: {message}",
        errors=[{"field": "payloads", "message": message}],
    )


async def _payloads(request: Request, caller: Principal) -> Payloads:
    require_codec_role(caller)
    raw = await request.body()
    if _too_deep(raw):
        raise _invalid(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        document = json.loads(raw)
        # The documented shape first (what the OpenAPI document promises),
        # then protobuf's own parse of the same document.
        PayloadsIn.model_validate(document)
        return ParseDict(document, Payloads())
    except (ParseError, ValueError, TypeError, RecursionError) as exc:
        raise _invalid(str(exc)) from exc


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


@router.post("/encode", **_CODEC_DOC)
async def encode(request: Request, caller: CodecCaller) -> dict[str, Any]:
    return await _encode(request, caller)


@router.post("/decode", **_CODEC_DOC)
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


# The embedded stack's UI: `temporal server start-dev` takes its codec endpoint
# only on the command line, which every local user can list, so no token goes
# there. Instead, with ROUNDTABLE_UI_CODEC_LOOPBACK on (`roundtable dev` turns
# it on), /codec/ui serves the UI's page in a browser of the API's own user:
# the peer must be loopback and (on Linux) owned by our uid, the Host a
# loopback name (a DNS-rebound page names its own host) and the Origin, which
# browsers send on every cross-origin POST and pages cannot forge, one of the
# UI's. A process of our own user can pass all of these (it can read our
# files anyway), and so can anything it forwards to the port: never forward
# the dev API's port.
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def _is_loopback(address: str | None) -> bool:
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _loopback_ui_caller(request: Request, ctx: Context) -> Principal:
    if not ctx.settings.ui_codec_loopback:
        raise Problem(404, "not_found", "the loopback codec endpoint is off")
    try:
        host = urlsplit("//" + request.headers.get("host", "")).hostname
    except ValueError:
        host = None
    origin = request.headers.get("origin")
    peer = request.client.host if request.client else None
    if not _is_loopback(peer) or host not in _LOOPBACK_HOSTS:
        raise Problem(403, "forbidden", "the loopback codec endpoint serves this machine only")
    if origin not in ctx.settings.ui_origins:
        raise Problem(403, "forbidden", "the loopback codec endpoint serves the Temporal UI only")
    if socket_owners_listed() and _peer_owner(request) != os.getuid():
        # A process of another local user can send any Origin it likes; its
        # socket, though, is listed with its owner.
        raise Problem(403, "forbidden", "the loopback codec serves the API's own user only")
    return Principal(user_id="temporal-ui", role="codec")


def _peer_owner(request: Request) -> int | None:
    server = request.scope.get("server")
    if request.client is None or not server:
        return None
    return peer_uid(request.client.port, server[1])


@router.post("/ui/encode", include_in_schema=False)
async def encode_for_local_ui(request: Request, ctx: Context) -> dict[str, Any]:
    return await _encode(request, _loopback_ui_caller(request, ctx))


@router.post("/ui/decode", include_in_schema=False)
async def decode_for_local_ui(request: Request, ctx: Context) -> dict[str, Any]:
    return await _decode(request, _loopback_ui_caller(request, ctx))
