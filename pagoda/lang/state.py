"""ProgramState: the text a program builds with `+=`, its variables, and forks.

Appends run in order on the state's own worker thread, so `+=` returns at once and the forks of
a state generate concurrently (the engine batches them). Reading `s["var"]` or `s.text()` waits
for the appends before it.

Dict appends write JSON: `s += {"name": gen("name", max_len=8)}` writes `{"name": "<generated>"`,
and the next dict append continues the same object (`, "age": ...`); the object closes at the
next non-dict append or when the program returns. A gen value without a constraint becomes a
JSON string (the model writes its closing quote); one with a regex is written as generated and
ends where the model would write `,` or `}`; a schema value is written as generated (an object,
a number); a choice is quoted.

A state with a `session_id` runs every request as a turn of that session, so the engine keeps
its prefix pinned in the prefix cache between runs (a conversation's next turn computes only its
new tokens). A fork's shared prefix is prefilled on the session; its branches run without one,
so a branch's own tail never displaces the session's pinned prefix.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagoda.lang.endpoint import Generated
from pagoda.lang.ir import Gen, Role

# A JSON string's characters, then its closing quote: lets a free gen inside a dict end itself.
_JSON_STRING_BODY = r'([^"\\\x00-\x1f]|\\["\\/bfnrt])*"'


class ProgramState:
    def __init__(self, backend, text: str = "", variables: dict | None = None, session_id: str | None = None) -> None:
        self.backend = backend
        self.session_id = session_id
        self._text = text
        self._vars: dict[str, Any] = dict(variables or {})
        self._meta: dict[str, Generated] = {}
        self._open_object = False
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagoda-lang-state")
        self._last: Future | None = None

    # -- appending --------------------------------------------------------------------------
    def __iadd__(self, item: Any) -> "ProgramState":
        self._last = self._worker.submit(self._append, item)
        return self

    def _append(self, item: Any) -> None:
        if isinstance(item, dict):
            self._append_object(item)
            return
        self._close_object()
        if isinstance(item, str):
            self._text += item
        elif isinstance(item, Gen):
            self._generate(item)
        elif isinstance(item, Role):
            prefix, suffix = self.backend.role_markers(item.role)
            self._text += prefix
            for part in item.items:
                self._append(part)
            self._close_object()
            self._text += suffix
        elif isinstance(item, (list, tuple)):
            for part in item:
                self._append(part)
        else:
            raise TypeError(f"cannot append {type(item).__name__} to a program state; use str, gen(), select(), a role or a dict")

    def _generate(self, g: Gen) -> str:
        result = self.backend.generate(self._text, g, **self._session())
        self._text += result.text
        self._set(g.name, result.text, result)
        return result.text

    def _session(self) -> dict:
        # Only passed when set, so a backend without sessions still runs session-less programs.
        return {"session_id": self.session_id} if self.session_id is not None else {}

    def _set(self, name: str | None, value: Any, result: Generated) -> None:
        if name is not None:
            self._vars[name] = value
            self._meta[name] = result

    def _append_object(self, item: dict) -> None:
        for key, value in item.items():
            self._text += (", " if self._open_object else "{") + json.dumps(str(key), ensure_ascii=False) + ": "
            self._open_object = True
            if not isinstance(value, Gen):
                self._text += json.dumps(value, ensure_ascii=False)
            elif value.regex is None and value.choices is None and value.json_schema is None:
                self._json_string(value)
            elif value.choices is not None:
                self._text += '"'
                self._generate(value)
                self._text += '"'
            elif value.regex is not None:
                self._json_regex_value(value)
            else:
                self._generate(value)

    def _json_string(self, g: Gen) -> None:
        """A free gen as a JSON string value: the model writes the body and the closing quote."""
        self._text += '"'
        constrained = Gen(g.name, g.max_tokens, g.stop, regex=_JSON_STRING_BODY, temperature=g.temperature,
                          top_p=g.top_p, seed=g.seed)
        result = self.backend.generate(self._text, constrained, **self._session())
        body = result.text[:-1] if result.text.endswith('"') else result.text
        self._text += body + '"'
        self._set(g.name, json.loads(f'"{body}"') if _valid_json_string(body) else body, result)

    def _json_regex_value(self, g: Gen) -> None:
        """A regex value inside an object: the model may also write the `,` or `}` that ends
        it, so it stops where JSON would (not at max_tokens); that character is dropped."""
        constrained = Gen(g.name, g.max_tokens, g.stop, regex=f"({g.regex})[,}}]", temperature=g.temperature,
                          top_p=g.top_p, seed=g.seed)
        result = self.backend.generate(self._text, constrained, **self._session())
        value = result.text[:-1] if len(result.text) > 1 and result.text[-1] in ",}" else result.text
        self._text += value
        self._set(g.name, value, result)

    def _close_object(self) -> None:
        if self._open_object:
            self._text += "}"
            self._open_object = False

    # -- reading ----------------------------------------------------------------------------
    def sync(self) -> "ProgramState":
        """Wait for every append so far (re-raising its error)."""
        self._worker.submit(lambda: None).result()
        if self._last is not None:
            self._last.result()
        return self

    def text(self) -> str:
        self.sync()
        return self._text + ("}" if self._open_object else "")

    def __getitem__(self, name: str) -> Any:
        self.sync()
        return self._vars[name]

    def get(self, name: str, default: Any = None) -> Any:
        self.sync()
        return self._vars.get(name, default)

    @property
    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._vars)

    def meta(self, name: str) -> Generated:
        """Token counts of the gen that set `name`, cached prompt tokens included."""
        self.sync()
        return self._meta[name]

    def finish(self) -> "ProgramState":
        """Close an open JSON object: the program has returned."""
        self._worker.submit(self._close_object).result()
        return self.sync()

    # -- forks ------------------------------------------------------------------------------
    def fork(self, n: int) -> "Forks":
        """n branches that continue from this state's text. The shared prefix is computed once
        first, so every branch reads it from the prefix cache."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs a positive number of branches, got {n!r}")
        self.finish()
        self.backend.prefill(self._text, **self._session())
        return Forks(ProgramState(self.backend, self._text, self._vars) for _ in range(n))

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class Forks(list):
    def join(self) -> list[ProgramState]:
        for branch in self:
            branch.sync()
        return list(self)


def _valid_json_string(body: str) -> bool:
    try:
        json.loads(f'"{body}"')
        return True
    except ValueError:
        return False
