"""The dialogue manager's policy: what to do next, given the dialogue state and the NLU result.

A policy is any callable `(state, nlu) -> Action`: write it as code, or as a `StateTable`.
An `Action` is what the assistant says (NLG): template text formatted with the current topic's
slot values, a slot's question, free generation, and whether the current topic is done.

    table = StateTable({
        ("booking", "missing"): ask(),                     # the first empty slot's question
        ("booking", "ok"): complete("Booked for {name}."),  # an intent name is a condition
        ("booking", "filled"): say("{party_size} people on {day}: shall I book it?"),
        ("question", "always"): answer(),                  # free generation on the transcript
        (None, "hello"): say("Hello! How can I help?"),    # None: no topic; "*": any topic
    })
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagoda.dialogue.nlu import Understanding
    from pagoda.dialogue.topics import Frame, TopicStack


@dataclass(frozen=True)
class Action:
    name: str
    say: str = ""  # template text, formatted with the current topic's slots ({party_size})
    ask: str | bool = False  # ask for a slot: its name, or True for the first missing one
    generate: bool = False  # then generate freely (chit-chat, answers to a digression)
    then: str = ""  # template text after the generated part
    regex: str | None = None  # constrains the generated part (e.g. to one sentence)
    complete: bool = False  # the current topic is done: pop it (the interrupted one resumes)


def say(text: str, name: str = "say") -> Action:
    return Action(name, say=text)


def ask(slot: str | None = None, prefix: str = "", name: str = "ask") -> Action:
    """Ask for `slot` (default: the current topic's first missing slot) with its question."""
    return Action(name, say=prefix, ask=slot or True)


def answer(prefix: str = "", then: str = "", regex: str | None = None, name: str = "answer") -> Action:
    """Free generation on the transcript (the model answers with the whole conversation as
    context), after `prefix` and before `then`; `regex` constrains it."""
    return Action(name, say=prefix, generate=True, then=then, regex=regex)


def complete(text: str = "", name: str = "complete") -> Action:
    """Finish the current topic, saying `text`."""
    return Action(name, say=text, complete=True)


@dataclass
class DialogueState:
    """What a policy sees: the topic stack, the topic that resumed this turn (if any), the turn."""

    stack: TopicStack
    resumed: Frame | None = None
    turn: int = 0

    @property
    def current(self) -> Frame | None:
        return self.stack.current

    @property
    def topic(self) -> str | None:
        return self.stack.current.name if self.stack.current is not None else None


Policy = Callable[[DialogueState, "Understanding"], Action]
Condition = Callable[[DialogueState, "Understanding"], bool]

BUILTIN_CONDITIONS: dict[str, Condition] = {
    "always": lambda state, nlu: True,
    "missing": lambda state, nlu: state.current is not None and not state.current.filled,
    "filled": lambda state, nlu: state.current is not None and state.current.filled,
    "resumed": lambda state, nlu: state.resumed is not None and state.resumed is state.current,
    "informed": lambda state, nlu: bool(nlu.slots),  # the message filled a slot
}


class StateTable:
    """A policy as a table {(topic, condition): action}, tried in order; the first entry whose
    topic matches the current one (None: no topic, "*": any) and whose condition holds gives
    the action. A condition is a name (an intent, a built-in condition: always, missing, filled,
    resumed, informed; or one of `conditions`), a callable (state, nlu) -> bool, or a tuple of
    conditions that must all hold. An action is an `Action` or a callable (state, nlu) -> Action."""

    def __init__(self, table: Mapping[tuple[str | None, Any], Action | Policy],
                 conditions: Mapping[str, Condition] | None = None, default: Action | None = None) -> None:
        self.table = list(table.items())
        self.conditions = {**BUILTIN_CONDITIONS, **(conditions or {})}
        self.default = default or say("Sorry, I did not understand that.", name="fallback")

    def __call__(self, state: DialogueState, nlu: Understanding) -> Action:
        for (topic, condition), action in self.table:
            if (topic == "*" or topic == state.topic) and self._holds(condition, state, nlu):
                return action(state, nlu) if callable(action) else action
        return self.default

    def _holds(self, condition, state: DialogueState, nlu: Understanding) -> bool:
        if isinstance(condition, tuple):
            return all(self._holds(c, state, nlu) for c in condition)
        if callable(condition):
            return bool(condition(state, nlu))
        if condition in self.conditions:
            return bool(self.conditions[condition](state, nlu))
        return nlu.intent == condition
