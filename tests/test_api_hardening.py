"""Requests that once answered 500, and lists that had no end: each is a 4xx
problem document or a page now. Real HTTP against the real app."""

from __future__ import annotations

import base64

from tests.api_server import serve_api
from tests.workflow_harness import harness


def _cursor(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode()


async def test_a_cursor_with_a_naive_time_is_a_422_not_a_500(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        for raw in ("2024-01-01T00:00:00|run-x", "2024-01-01T00:00:00+00:00", "\x00|\x00"):
            answer = await api.http.get(
                "/v1/runs", params={"cursor": _cursor(raw)}, headers=api.auth("alice")
            )
            assert answer.status_code == 422, (raw, answer.text)
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["errors"][0]["field"] == "cursor"
        aware = _cursor("2024-01-01T00:00:00+00:00|run-x")
        fine = await api.http.get("/v1/runs", params={"cursor": aware}, headers=api.auth("alice"))
        assert fine.status_code == 200, fine.text


async def test_codec_decode_of_1000_deep_json_is_a_422_not_a_500(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        headers = {**api.auth("ops"), "Content-Type": "application/json"}
        for body in (
            "[" * 1000 + "]" * 1000,
            '{"payloads": ' + "[" * 1000 + "]" * 1000 + "}",
            '{"payloads": [{"metadata": {"a": ' + '{"b": ' * 999 + "1" + "}" * 1000 + "}]}",
        ):
            for path in ("/codec/decode", "/codec/encode"):
                answer = await api.http.post(path, content=body.encode(), headers=headers)
                assert answer.status_code == 422, (path, answer.text[:300])
                assert answer.json()["code"] == "validation_error"
        # Brackets inside strings are text, not nesting.
        shallow = '{"payloads": [{"metadata": {"x": "' + "[" * 1000 + '"}}]}'
        answer = await api.http.post("/codec/decode", content=shallow.encode(), headers=headers)
        assert answer.status_code != 500, answer.text
