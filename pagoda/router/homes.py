"""Where a replica's stored things live, for the router: stored responses (`/v1/responses/{id}`,
`previous_response_id`), uploaded and written files (`/v1/files/{id}`, a batch's
`input_file_id`) and batch jobs (`/v1/batches/{id}`) are kept by the replica that made them
(entrypoints/state_db.py), so a request that names one must reach that replica.

The router learns a thing's home from the answer that created it (a JSON body with its `id`)
and from any request a replica answered about it; one it has not seen (made before the router
started, or named in a stream it did not read) is looked for: the request goes to each replica
in turn until one does not answer 404. That is safe because every such route answers 404
before doing anything. Lists (`GET /v1/files`, `GET /v1/batches`) are the replicas' lists
together, newest first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import orjson

MAX_HOMES = 100_000  # ids remembered (least recently used forgotten: the lookup finds them again)
_BY_PATH = ("/v1/responses/", "/v1/files/", "/v1/batches/")
CREATING = ("/v1/responses", "/v1/files", "/v1/batches")  # POSTs whose JSON answer names a new thing
LISTS = ("/v1/files", "/v1/batches")


def named_thing(method: str, path: str, body: Any) -> str | None:
    """The id of the stored thing a request is about, if it is about one."""
    path = path.split("?", 1)[0]
    for prefix in _BY_PATH:
        if path.startswith(prefix) and len(path) > len(prefix):
            return path[len(prefix):].split("/", 1)[0]
    if method == "POST" and isinstance(body, dict):
        if path == "/v1/responses" and isinstance(body.get("previous_response_id"), str):
            return body["previous_response_id"]
        if path == "/v1/batches" and isinstance(body.get("input_file_id"), str):
            return body["input_file_id"]
    return None


def created_id(method: str, path: str, status: int, content: bytes) -> str | None:
    """The id a creating POST's answer names (None for a stream, an error or another route)."""
    if method != "POST" or status != 200 or path.split("?", 1)[0] not in CREATING:
        return None
    try:
        answer = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return answer.get("id") if isinstance(answer, dict) and isinstance(answer.get("id"), str) else None


class Homes:
    """id → the URL of the replica that keeps it, least recently used forgotten first."""

    def __init__(self, capacity: int = MAX_HOMES) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()

    def get(self, thing: str) -> str | None:
        url = self._homes.get(thing)
        if url is not None:
            self._homes.move_to_end(thing)
        return url

    def remember(self, thing: str, url: str) -> None:
        self._homes[thing] = url
        self._homes.move_to_end(thing)
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def forget_worker(self, url: str) -> None:
        for thing in [t for t, home in self._homes.items() if home == url]:
            del self._homes[thing]


def merged_list(answers: list[bytes]) -> bytes:
    """The replicas' list answers as one list, newest first."""
    items: list[dict] = []
    for content in answers:
        try:
            answer = orjson.loads(content)
        except orjson.JSONDecodeError:
            continue
        if isinstance(answer, dict) and isinstance(answer.get("data"), list):
            items += answer["data"]
    items.sort(key=lambda item: item.get("created_at") or 0, reverse=True)
    return orjson.dumps({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                         "last_id": items[-1]["id"] if items else None, "has_more": False})
