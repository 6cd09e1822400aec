"""The two pages and their static files (HTML, JavaScript, CSS, vendored libraries)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def install_pages(app: FastAPI) -> None:
    """`/` (the playground), `/dashboard`, and the files under `/web/`. The pages are open (no
    key needed to load them, see middleware.OPEN_PATHS); they ask for a key when the API wants one."""

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "playground.html", headers=_NO_STORE)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard():
        return FileResponse(STATIC / "dashboard.html", headers=_NO_STORE)

    app.mount("/web", StaticFiles(directory=STATIC), name="web")


# The HTML is small and names the scripts it loads: always fetched, so an upgrade shows at once.
_NO_STORE = {"Cache-Control": "no-cache"}
