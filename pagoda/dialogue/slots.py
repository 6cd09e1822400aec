"""Entity slots: a value with a JSON-schema type, filled from the user's current message.

Extraction is grounded in the message: `Slot.candidates(message)` lists the spans of the message
that could be the slot's value (numbers for an integer, the enum's words for an enum, matches of
a string's pattern, capitalized words for a free string), each with the JSON value it stands
for, and the model only chooses one of them or "none" (a constrained `select`). A 135M model
cannot be trusted to write a value from scratch (it copies the few-shot examples), but it can
pick the right span; a message without any candidate costs no model call at all. Every value is
then validated against the slot's schema with `jsonschema`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

NONE = "none"  # the extraction prompts' answer for "the message does not give it"

NUMBER_WORDS = {w: i for i, w in enumerate(
    ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"])}

_DIGITS = re.compile(r"(?<![\d:.])\d+(?![\d:])")  # a number, not a part of a time or a decimal
_WORD = re.compile(r"[A-Za-z]+")
_CAPITALIZED = re.compile(r"\b[A-Z][a-z]+\b")


@dataclass(frozen=True)
class Candidate:
    span: str  # the text as the message has it ("four", "Friday", "19:30")
    value: Any  # the JSON value it stands for (4, "friday", "19:30")


@dataclass
class Slot:
    """`schema` types the value (JSON schema); `question` is what the assistant says to ask for
    it. The extraction prompt reads `instruction`, then `examples` of (message, the span of it
    that is the value, or None), then `label: ` and the answer. `spans` (a regex) overrides the
    candidates the schema gives."""

    name: str
    schema: dict
    question: str
    label: str = ""
    instruction: str = ""
    examples: Sequence[tuple[str, str | None]] = field(default_factory=tuple)
    spans: str | None = None

    def __post_init__(self) -> None:
        self.label = self.label or self.name.replace("_", " ").capitalize()
        self.instruction = self.instruction or (
            f"What is the {self.label.lower()} in the message? Answer {NONE} if the message does not say.")
        _validator(json.dumps(self.schema, sort_keys=True)).check_schema(self.schema)
        for message, answer in self.examples:
            spans = [c.span for c in self.candidates(message)]
            if answer is not None and answer not in spans:
                raise ValueError(f"slot {self.name!r}: example answer {answer!r} is not a candidate of "
                                 f"{message!r} (candidates: {spans})")

    def candidates(self, message: str) -> list[Candidate]:
        """The spans of `message` that could fill this slot, with their values, in order."""
        found: list[Candidate] = []
        for span, value in self._raw_candidates(message):
            if self.is_valid(value) and all(c.span != span for c in found):
                found.append(Candidate(span, value))
        return found

    def _raw_candidates(self, message: str):
        schema = self.schema
        if self.spans is not None:
            for m in re.finditer(self.spans, message):
                yield m.group(0), self.parse(m.group(0))
        elif "enum" in schema:
            lowered = {str(v).lower(): v for v in schema["enum"]}
            for m in _WORD.finditer(message):
                if m.group(0).lower() in lowered:
                    yield m.group(0), lowered[m.group(0).lower()]
        elif schema.get("type") in ("integer", "number"):
            spans = [(m.start(), m.group(0), int(m.group(0))) for m in _DIGITS.finditer(message)]
            spans += [(m.start(), m.group(0), NUMBER_WORDS[m.group(0).lower()]) for m in _WORD.finditer(message)
                      if m.group(0).lower() in NUMBER_WORDS]
            for _, span, value in sorted(spans):
                yield span, value
        elif schema.get("type") == "string" and "pattern" in schema:
            for m in re.finditer(_unanchored(schema["pattern"]), message):
                yield m.group(0), m.group(0)
        elif schema.get("type") == "string":
            for m in _CAPITALIZED.finditer(message):
                yield m.group(0), m.group(0)

    def parse(self, span: str) -> Any:
        """A span's value under the schema's type (a `spans` match)."""
        if self.schema.get("type") in ("integer", "number"):
            return NUMBER_WORDS.get(span.lower()) if span.lower() in NUMBER_WORDS else int(span)
        return span

    def is_valid(self, value: Any) -> bool:
        return _validator(json.dumps(self.schema, sort_keys=True)).is_valid(value)

    def validate(self, value: Any) -> None:
        """Raise jsonschema's ValidationError when `value` does not fit the schema."""
        _validator(json.dumps(self.schema, sort_keys=True)).validate(value)

    def prompt(self) -> str:
        """The extraction prompt's constant part (shared by every turn, so prefix-cached)."""
        shots = "".join(f"Message: {m}\n{self.label}: {NONE if a is None else a}\n\n" for m, a in self.examples)
        return f"{self.instruction}\n\n{shots}"

    def query(self, message: str) -> str:
        return f"{self.prompt()}Message: {message}\n{self.label}:"


def _unanchored(pattern: str) -> str:
    return pattern.removeprefix("^").removesuffix("$")


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str):
    try:
        import jsonschema  # optional: jsonschema may be absent
    except ImportError as e:  # a test extra of pagoda, not a core dependency
        raise ImportError("pagoda.dialogue validates slots with jsonschema: pip install jsonschema") from e
    schema = json.loads(schema_json)
    return jsonschema.validators.validator_for(schema)(schema)
