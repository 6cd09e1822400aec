"""Ollama's HTTP API (`/api/...`) on `pagoda serve`, beside the OpenAI one (`/v1/...`).

`/api/generate` and `/api/chat` (and, for an embedding model, `/api/embed`: embed.py) run on the served model through the same `Serving` as `/v1`
(admission, `--request-timeout`, metrics): NDJSON lines when `stream` is true (Ollama's default),
one JSON object otherwise, with Ollama's timing fields in nanoseconds. `options` map to sampling
parameters, `format` ("json" or a JSON schema) to structured outputs. `/api/tags`, `/api/show`,
`/api/ps` and `/api/version` describe what is served; `/api/pull`, `/api/push`, `/api/delete`,
`/api/copy` and `/api/create` act on the model store (`pagoda/store`), as `pagoda pull/push/rm/cp/
create` do. On a server of one model, a store model that is not the served one can be listed,
shown, copied, pushed or deleted but not run (404 naming the served model), and `keep_alive` is
accepted and ignored: the served model stays loaded until the server stops. With several models,
this router runs on each model's app and on the front (model_dispatch.py), which answers
`/api/tags`, `/api/ps` and Ollama's keep_alive itself.

Errors are Ollama's: `{"error": "..."}` with 400 (bad request), 404 (no such model), 501 (a
feature pagoda does not have), 503 (engine gone or draining), 500 (registry or store failure).
"""

from fastapi import APIRouter

from pagoda.entrypoints.ollama import embed, generation, models, store_routes

router = APIRouter()
for part in (generation, embed, models, store_routes):
    router.include_router(part.router)

