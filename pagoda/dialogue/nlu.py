"""NLU: the user's intent (a `select` over the intents) and slot values (a `select` over the spans
of the message that fit each slot, or "none"), from the CURRENT message.

Each query runs off the transcript, on a few-shot prompt of its own that never changes (so after
the first turn the prefix cache serves it and a query computes only the message): the intent
prompt lists the intents' examples as `message => intent` lines; each slot has its own prompt
(`Slot.prompt`). The queries of one message run concurrently (each on its own program state;
the engine batches them). They carry session ids of their own (`<name>.intent`,
`<name>.slot.<slot>`), so the engine keeps their prompts pinned while the dialogue lives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda import lang
from pagoda.dialogue.slots import NONE, Slot


@dataclass
class Understanding:
    """What NLU made of one message."""

    intent: str
    slots: dict[str, Any] = field(default_factory=dict)  # slot name -> value (validated)
    spans: dict[str, str] = field(default_factory=dict)  # slot name -> the span it came from
    message: str = ""


def interleave(examples: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(message, intent) pairs taking one example of each intent in turn, so no intent owns the
    end of the prompt (a small model leans towards the labels it read last)."""
    queues = {intent: list(msgs) for intent, msgs in examples.items()}
    out: list[tuple[str, str]] = []
    while any(queues.values()):
        for intent, msgs in queues.items():
            if msgs:
                out.append((msgs.pop(0), intent))
    return out


class NLU:
    def __init__(self, intents: Mapping[str, Sequence[str]], slots: Sequence[Slot], *, domain: str = "a customer",
                 name: str = "dialogue") -> None:
        if not intents:
            raise ValueError("NLU needs at least one intent, each with example messages")
        self.intents = list(intents)
        self.slots = list(slots)
        self.name = name
        shots = "".join(f"{m} => {i}\n" for m, i in interleave(intents))
        # A system turn (the instruction) and an open user turn (the examples, then the message
        # and " =>"), in the backend's chat template's markers: built on first use.
        self._intent_instruction = f"Classify the message of {domain}. Intents: {', '.join(self.intents)}."
        self._intent_shots = f"Examples:\n{shots}"
        self._intent_prompt: str | None = None

    def intent_prompt(self, backend) -> str:
        if self._intent_prompt is None:
            sys_open, sys_close = backend.role_markers("system")
            user_open, _ = backend.role_markers("user")
            self._intent_prompt = f"{sys_open}{self._intent_instruction}{sys_close}{user_open}{self._intent_shots}"
        return self._intent_prompt

    def session_ids(self) -> list[str]:
        return [f"{self.name}.intent"] + [f"{self.name}.slot.{s.name}" for s in self.slots]

    def prepare(self, backend) -> None:
        """Prefill every NLU prompt on its session id."""
        backend.prefill(self.intent_prompt(backend), session_id=f"{self.name}.intent")
        for slot in self.slots:
            backend.prefill(slot.prompt(), session_id=f"{self.name}.slot.{slot.name}")

    def understand(self, backend, message: str, slots: Sequence[Slot] | None = None) -> Understanding:
        """Classify `message` and extract `slots` (default: all) from it, concurrently."""
        message = " ".join(message.split())  # one line: the prompts are line-based
        intent = lang.ProgramState(backend, session_id=f"{self.name}.intent")
        intent += self.intent_prompt(backend) + f"{message} =>"
        intent += lang.select("intent", [f" {i}" for i in self.intents])
        extractions = []
        for slot in self.slots if slots is None else slots:
            candidates = slot.candidates(message)
            if not candidates:
                continue  # nothing in the message could fill it: no model call
            state = lang.ProgramState(backend, session_id=f"{self.name}.slot.{slot.name}")
            state += slot.query(message)
            state += lang.select("value", [f" {NONE}"] + [f" {c.span}" for c in candidates])
            extractions.append((slot, candidates, state))
        try:
            result = Understanding(intent["intent"].strip(), message=message)
            for slot, candidates, state in extractions:
                picked = state["value"].strip()
                for c in candidates:
                    if c.span == picked:
                        slot.validate(c.value)
                        result.slots[slot.name] = c.value
                        result.spans[slot.name] = c.span
            return result
        finally:
            for state in [intent] + [s for _, _, s in extractions]:
                state.close()
