"""The web side of `pagoda serve`: the playground (`/`), the engine dashboard (`/dashboard`) and
the JSON debug API they read (`/v1/debug/...`).

`install_web(app)` is the one call `build_app` makes. The pages are static files shipped in the
package (`static/`, with vendored front-end libraries and their licences: no CDN, no external
fonts) and talk to the server's public API like any client; the debug API asks the engine's
recorder (pagoda/engine/step_trace.py) for snapshots.
"""

from __future__ import annotations

from fastapi import FastAPI

from pagoda.entrypoints.web.debug_api import DebugFeed, router as debug_router
from pagoda.entrypoints.web.pages import install_pages


def install_web(app: FastAPI, web_ui: bool = True) -> None:
    """The debug API always (other tools read it); the pages unless `web_ui` is False
    (`pagoda serve --no-web-ui`)."""
    app.state.debug_feed = DebugFeed(app.state.serving)
    app.include_router(debug_router)
    if web_ui:
        install_pages(app)
