"""/docs works offline: every asset it loads is served by the API itself."""

from __future__ import annotations

import re

from tests.api_server import serve_api
from tests.workflow_harness import harness


async def test_docs_work_offline_with_no_cdn_url_in_the_served_html(tmp_path) -> None:
    async with harness(tmp_path) as h, serve_api(h) as api:
        page = await api.http.get("/docs")
        assert page.status_code == 200
        html = page.text
        assert "cdn" not in html.lower()
        assert not re.search(r"(?:src|href)=[\"']?(?:https?:)?//", html), html
        assets = re.findall(r"(?:src|href)=[\"']([^\"']+)[\"']", html)
        assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
        for asset in assets:
            served = await api.http.get(asset)
            assert served.status_code == 200, asset
            assert "cdn.jsdelivr" not in served.text
        assert "'/openapi.json'" in html or '"/openapi.json"' in html
        # ReDoc has no packaged assets: off, rather than a page that needs a CDN.
        assert (await api.http.get("/redoc")).status_code == 404
