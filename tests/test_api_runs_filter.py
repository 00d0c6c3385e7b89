"""GET /v1/runs?user_id=: an operator's view of one user's runs; a user's
own view stays their own, whoever they ask for."""

from __future__ import annotations

from tests.api_server import serve_api
from tests.test_api import start
from tests.workflow_harness import harness


async def test_runs_are_filtered_by_user_for_those_who_see_all(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        alices = (await start(api, who="alice"))["run_id"]
        bobs = (await start(api, who="bob"))["run_id"]

        async def listed(who: str, **params: str) -> list[str]:
            response = await api.http.get("/v1/runs", params=params, headers=api.auth(who))
            assert response.status_code == 200, response.text
            return [r["run_id"] for r in response.json()["items"]]

        assert await listed("ops") == [alices, bobs]
        assert await listed("ops", user_id="alice") == [alices]
        assert await listed("svc", user_id="bob") == [bobs]
        assert await listed("ops", user_id="nobody") == []
        assert await listed("alice", user_id="alice") == [alices]
        assert await listed("alice", user_id="bob") == []  # not bob's runs: none
        too_long = await api.http.get(
            "/v1/runs", params={"user_id": "x" * 256}, headers=api.auth("ops")
        )
        assert too_long.status_code == 422
