"""What a program appends to its state: text, generation calls, selections, roles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Gen:
    """Generate text into variable `name`. `regex`, `choices` and `json_schema` constrain it
    (structured outputs); `stop` ends it at a string."""

    name: str | None
    max_tokens: int = 128
    stop: str | list[str] | None = None
    regex: str | None = None
    choices: list[str] | None = None
    json_schema: dict | str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("regex", "choices", "json_schema") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"gen({self.name!r}) takes one of regex, choices, json_schema; got {', '.join(given)}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"gen({self.name!r}) max_tokens must be a positive integer, got {self.max_tokens!r}")


def gen(name: str | None = None, max_tokens: int | None = None, *, max_len: int | None = None, stop=None,
        regex: str | None = None, choices: list[str] | None = None, json_schema: dict | str | None = None,
        temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Gen:
    """`max_len` is SGLang's older name for max_tokens."""
    if max_tokens is not None and max_len is not None and max_tokens != max_len:
        raise ValueError(f"gen({name!r}): give max_tokens or max_len, not both")
    limit = max_tokens if max_tokens is not None else (max_len if max_len is not None else 128)
    return Gen(name, limit, stop, regex, choices, json_schema, temperature, top_p, seed)


def select(name: str | None, choices: list[str], temperature: float = 0.0) -> Gen:
    """Pick one of `choices` (the model's likeliest under greedy decoding)."""
    if not choices:
        raise ValueError(f"select({name!r}) needs at least one choice")
    return Gen(name, max_tokens=max(1, max(len(c) for c in choices)), choices=list(choices), temperature=temperature)


@dataclass
class Role:
    """A chat turn: the template's opening for `role`, the items, then its closing."""

    role: str
    items: list[Any] = field(default_factory=list)


def _role(role: str):
    def make(*items: Any) -> Role:
        return Role(role, list(items))

    make.__name__ = role
    make.__doc__ = f"A {role} turn: `s += {role}(\"text\", gen(...), ...)`."
    return make


system = _role("system")
user = _role("user")
assistant = _role("assistant")
