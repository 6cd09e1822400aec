"""pagoda on Ray Serve (`pagoda serve --ray-serve`, `pagoda.ray_serve.build_app`): engine
replicas as an autoscaled Serve deployment behind an OpenAI-compatible ingress, routed by
pagoda's policies as a custom request router (docs/scaling-out.md, "Ray Serve").

- `app`: the application (`build_app`) and the command (`run`)
- `engine_replica`: one engine and its OpenAI app in a Serve replica
- `ingress`: the endpoint behind Serve's proxy; the retry of a request whose replica died
- `request_router`: pagoda's policies as Serve's `RequestRouter`
- `autoscaling`: Serve's autoscaling config from pagoda's flags; the forecast policy
- `asgi_bridge`: a request as data, played into the replica's app
- `options`: the command line (imports nothing heavy, for `pagoda --help`)
"""

from __future__ import annotations

from typing import Any


def build_app(*args: Any, **kwargs: Any) -> Any:
    """`pagoda.ray_serve.app.build_app`: the Serve application of pagoda on a model."""
    from pagoda.ray_serve.app import build_app as build  # deferred: loads ray, torch and the server

    return build(*args, **kwargs)
