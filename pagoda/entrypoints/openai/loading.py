"""What /health says while the model loads layer by layer (loader/progressive_load.py).

Requests are taken from the start either way: one that arrives while the model loads runs each
layer as it arrives. ``--ready-when`` decides only when /health turns 200, which is what load
balancers, Kubernetes readiness probes and the router read as "send me traffic at normal latency":

- ``loaded`` (the default): 503 with code ``model_loading`` until every layer is in place, then
  200, so 200 keeps its meaning (a whole-model load gave none before the model was in);
- ``serving``: 200 as soon as the server takes requests, for a client that would rather wait on
  its first request than poll.

While loading, both answers carry ``X-Pagoda-Loading: <layers in place>/<layers>`` and the progress
in the body; the router (router/workers.py) keeps such a replica at the start of its warm-up ramp.
A load that failed answers 503 with code ``model_load_failed``.
"""

from __future__ import annotations

from fastapi import Response

from pagoda.entrypoints.openai.errors import OpenAIError
from pagoda.entrypoints.openai.middleware import FastJSONResponse, error_response

LOADING_HEADER = "X-Pagoda-Loading"


def loading_health(progress: dict | None, ready_when: str) -> Response:
    """/health's answer for a running engine: ``progress`` is its model's loading state (None:
    loaded whole)."""
    if progress is None or (not progress["loading"] and progress["error"] is None):
        return Response(status_code=200)
    if progress["error"] is not None:
        return error_response(OpenAIError(f"loading the model failed: {progress['error']}", status=503,
                                           type_="server_error", code="model_load_failed"))
    headers = {LOADING_HEADER: f"{progress['layers_loaded']}/{progress['num_layers']}"}
    if ready_when == "serving":
        return FastJSONResponse({"status": "loading", **progress}, status_code=200, headers=headers)
    message = (f"the model is loading: {progress['layers_loaded']} of {progress['num_layers']} layers in place "
               "(requests are taken and run as the layers arrive)")
    return error_response(OpenAIError(message, status=503, type_="server_error", code="model_loading",
                                      headers=headers))
