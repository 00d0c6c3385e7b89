"""Every route of the API by every kind of caller, over real HTTP.

The routes come from the app's own OpenAPI document, so a route added without
a row here fails this test instead of going unchecked."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from api.problems import Problem
from api.routes.codec import _loopback_ui_caller
from roundtable.config import Settings
from tests.api_server import serve_api
from tests.workflow_harness import harness, script, ticket_call

CALLERS = ("none", "wrong", "revoked", "other", "owner", "operator", "service", "codec")
UNAUTHENTICATED = {"none": 401, "wrong": 401, "revoked": 401}
NO_CODEC = {"codec": 403}

# (method, path) → the status each caller gets. "owner" is alice, whose run
# the ids point at; "other" is bob, another user.
EXPECTED: dict[tuple[str, str], dict[str, int]] = {
    ("post", "/v1/runs"): {"owner": 201, "other": 201, "operator": 201, "service": 422},
    ("get", "/v1/runs"): {"owner": 200, "other": 200, "operator": 200, "service": 200},
    **{
        ("get", path): {"owner": 200, "other": 404, "operator": 200, "service": 200}
        for path in (
            "/v1/runs/{run_id}",
            "/v1/runs/{run_id}/actions",
            "/v1/runs/{run_id}/approvals",
            "/v1/runs/{run_id}/events",
            "/v1/approvals/{approval_id}",
        )
    },
    ("get", "/v1/approvals"): {"owner": 200, "other": 200, "operator": 200, "service": 200},
    # A stale digest: whoever may decide gets as far as the conflict.
    ("post", "/v1/approvals/{approval_id}/decision"): {
        "owner": 409,
        "other": 404,
        "operator": 409,
        "service": 403,
    },
    ("post", "/v1/approvals/{approval_id}/extend"): {
        "owner": 200,
        "other": 404,
        "operator": 200,
        "service": 403,
    },
    # The action is waiting for approval, not unknown: operators reach the conflict.
    ("post", "/v1/actions/{action_id}/reconcile"): {
        "owner": 403,
        "other": 404,
        "operator": 409,
        "service": 403,
    },
    # The run is healthy: operators reach the refusal, nothing is reset.
    ("post", "/v1/runs/{run_id}/recover"): {
        "owner": 403,
        "other": 404,
        "operator": 409,
        "service": 403,
    },
    ("get", "/v1/webhook-deliveries"): {
        "owner": 403,
        "other": 403,
        "operator": 200,
        "service": 403,
    },
    ("post", "/codec/encode"): {
        "owner": 403,
        "other": 403,
        "operator": 200,
        "service": 403,
        "codec": 200,
    },
    ("post", "/codec/decode"): {
        "owner": 403,
        "other": 403,
        "operator": 200,
        "service": 403,
        "codec": 200,
    },
}
PUBLIC = {("get", "/healthz"), ("get", "/readyz")}

BODIES: dict[str, Any] = {
    "/v1/runs": {"task_text": "t"},
    "/v1/approvals/{approval_id}/decision": {
        "decision": "approved",
        "arguments_digest": "sha256:stale",
    },
    "/v1/approvals/{approval_id}/extend": {"seconds": 60},
    "/v1/actions/{action_id}/reconcile": {"outcome": "failed", "note": "checked"},
    "/v1/runs/{run_id}/recover": {"note": "checked"},
    "/codec/encode": {"payloads": []},
    "/codec/decode": {"payloads": []},
}


def expected(method: str, path: str, caller: str) -> int:
    if (method, path) in PUBLIC:
        return 200
    row = {**UNAUTHENTICATED, **NO_CODEC, **EXPECTED[(method, path)]}
    return row[caller]


async def test_every_route_for_every_caller(tmp_path) -> None:
    calls = [ticket_call("ticket_update", "T-1")]
    async with harness(tmp_path) as h, serve_api(h) as api:
        revoked_token, revoked = await h.store.create_token(user_id="eve", role="operator")
        await h.store.revoke_token(revoked["id"])
        headers = {
            "none": {},
            "wrong": {"Authorization": "Bearer rt_not-a-token"},
            "revoked": {"Authorization": f"Bearer {revoked_token}"},
            "other": api.auth("bob"),
            "owner": api.auth("alice"),
            "operator": api.auth("ops"),
            "service": api.auth("svc"),
            "codec": api.auth("ui"),
        }
        started = await api.http.post(
            "/v1/runs",
            json={"task_text": "t", "script": script(("seat-1", 1, calls))},
            headers=headers["owner"],
        )
        run_id = started.json()["run_id"]
        state = await h.wait_for(
            h.client.get_workflow_handle(run_id), lambda s: bool(s.pending_approvals)
        )
        (approval_id,) = state.pending_approvals
        action_id = (await h.store.get_approval(approval_id))["action_id"]
        ids = {"run_id": run_id, "approval_id": approval_id, "action_id": action_id}

        paths = (await api.http.get("/openapi.json")).json()["paths"]
        routes = {(m, p) for p, item in paths.items() for m in item if m in ("get", "post")}
        assert routes == set(EXPECTED) | PUBLIC, "a route without a row in the matrix"

        wrong = []
        for method, path in sorted(routes):
            url = path.format(**ids)
            for caller in CALLERS:
                response = await api.http.request(
                    method.upper(), url, headers=headers[caller], json=BODIES.get(path)
                )
                want = expected(method, path, caller)
                if response.status_code != want:
                    wrong.append((method, path, caller, want, response.status_code))
                elif response.status_code >= 400:
                    assert response.headers["content-type"].startswith(
                        "application/problem+json"
                    ), (method, path, caller)
        assert not wrong, "\n".join(map(str, wrong))
        # Nothing above decided anything.
        assert (await h.store.get_approval(approval_id))["status"] == "pending"


async def test_the_codec_path_takes_only_a_codec_token(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        body = {"payloads": []}
        assert (
            await api.http.post(f"/codec/t/{api.tokens['ui']}/decode", json=body)
        ).status_code == 200
        for who in ("ops", "alice", "svc"):
            response = await api.http.post(f"/codec/t/{api.tokens[who]}/decode", json=body)
            assert response.status_code == 403, who
        assert (await api.http.post("/codec/t/rt_nope/decode", json=body)).status_code == 401


async def test_the_loopback_codec_serves_only_the_local_ui_and_only_when_on(tmp_path) -> None:
    """The embedded stack's UI decodes with no token (one on the Temporal
    command line would be readable by every local user), so the endpoint must
    refuse every caller that is not a browser on this machine showing the UI."""
    body = {"payloads": []}
    ui = {"Origin": "http://127.0.0.1:8233"}
    async with harness(tmp_path) as h:
        async with serve_api(h) as api:
            off = await api.http.post("/codec/ui/decode", json=body, headers=ui)
            assert off.status_code == 404, off.text
        async with serve_api(h, ui_codec_loopback=True) as api:
            ok = await api.http.post("/codec/ui/decode", json=body, headers=ui)
            assert ok.status_code == 200, ok.text
            assert ok.headers["access-control-allow-origin"] == ui["Origin"]
            refused = {
                "no origin (not a browser page)": {},
                "another site's page": {"Origin": "https://evil.example"},
                "the UI's origin on another port": {"Origin": "http://127.0.0.1:9999"},
                "a DNS-rebound page": {"Host": "evil.example:8000", **ui},
                "a rebound subdomain of localhost": {"Host": "evil.localhost:8000", **ui},
                "localhost with a trailing dot": {"Host": "localhost.:8000", **ui},
                "a short-form address": {"Host": "127.1:8000", **ui},
            }
            for why, headers in refused.items():
                for path in ("/codec/ui/decode", "/codec/ui/encode"):
                    response = await api.http.post(path, json=body, headers=headers)
                    assert response.status_code == 403, (why, path)
            # It decodes and encodes, nothing else: no route under it reads runs.
            assert (await api.http.post("/codec/ui/encode", json=body, headers=ui)).is_success
            assert (await api.http.get("/codec/ui/v1/runs", headers=ui)).status_code == 404


def test_the_loopback_codec_refuses_a_peer_on_another_machine() -> None:
    """Reached through a 0.0.0.0 bind or a forward that names its client, the
    peer is remote: refused, whatever Origin and Host it sends."""

    def request(peer: str) -> Request:
        headers = [(b"host", b"127.0.0.1:8000"), (b"origin", b"http://127.0.0.1:8233")]
        scope = {"type": "http", "headers": headers, "client": (peer, 5555)}
        return Request({**scope, "server": ("127.0.0.1", 8000)})

    ctx = SimpleNamespace(settings=Settings(ui_codec_loopback=True))
    for peer in ("10.1.2.3", "192.168.0.7", "not-an-address"):
        with pytest.raises(Problem) as refused:
            _loopback_ui_caller(request(peer), ctx)
        assert refused.value.status == 403, peer


# Standard library only: it runs on the system's Python, which another user can
# execute (the project's virtualenv may not be readable to them).
_AS_ANOTHER_USER = """
import http.client, sys
connection = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=30)
connection.request("POST", "/codec/ui/decode", body='{"payloads": []}',
                   headers={"Origin": sys.argv[2], "Content-Type": "application/json"})
print(connection.getresponse().status)
"""
_SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
@pytest.mark.skipif(_SYSTEM_PYTHON is None, reason="no system python3 for another user to run")
async def test_the_loopback_codec_refuses_another_local_user(tmp_path) -> None:
    """Another user on this machine can send the UI's Origin and a loopback
    Host; the kernel still says whose socket it is."""
    ui = "http://127.0.0.1:8233"
    async with harness(tmp_path) as h, serve_api(h, ui_codec_loopback=True) as api:
        body, origin = {"payloads": []}, {"Origin": ui}
        mine = await api.http.post("/codec/ui/decode", json=body, headers=origin)
        assert mine.is_success, mine.text
        done = await asyncio.to_thread(
            subprocess.run,
            [_SYSTEM_PYTHON, "-c", _AS_ANOTHER_USER, str(api.http.base_url.port), ui],
            capture_output=True,
            text=True,
            timeout=60,
            user=65534,  # nobody
            check=False,
        )
        assert done.stdout.strip() == "403", done.stdout + done.stderr
