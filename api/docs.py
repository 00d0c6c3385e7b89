"""/docs served from this machine: no CDN, so it works offline and behind
egress filters. Swagger UI's assets come from the swagger-ui-bundle package;
ReDoc has no packaged assets, so it is switched off rather than half-working."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

ASSETS = "/docs/assets"


def install_docs(app: FastAPI) -> None:
    """Call on an app built with ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="swagger-ui-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - docs",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            # The default validator badge calls validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": True},
        )
