"""`/docs`: FastAPI's Swagger UI from the vendored copy, so the API reference works offline.

FastAPI's own `/docs` loads Swagger UI's script, stylesheet and favicon from a CDN; on a machine
without internet the page stayed blank. The apps are built with ``docs_url=None`` and this puts
the page back with every asset served by the server itself.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse

from pagoda.entrypoints.web.pages import STATIC

SWAGGER_DIR = STATIC / "vendor" / "swagger-ui"
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css"}


def install_api_docs(app: FastAPI) -> None:
    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json", title=f"{app.title} API",
            swagger_js_url="/docs/swagger-ui-bundle.js", swagger_css_url="/docs/swagger-ui.css",
            swagger_favicon_url="data:,",  # no request to a favicon host
            swagger_ui_parameters={"validatorUrl": None},  # Swagger's online validator badge: off
        )

    @app.get("/docs/{name}", include_in_schema=False)
    async def asset(name: str) -> FileResponse:
        if name not in ASSETS:  # a fixed set: no path from the URL reaches the file system
            return HTMLResponse("not found", status_code=404)
        return FileResponse(SWAGGER_DIR / name, media_type=ASSETS[name])
