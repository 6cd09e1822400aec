"""A dialogue application (`Dialogue`) and its conversations (`DialogueSession`).

Each turn is one `pagoda.lang` program run (`dialogue_turn`) on the session's transcript: a
`ProgramState` whose text is the conversation so far in the chat template's turns, run with the
session's id so the engine keeps its prefix pinned in the prefix cache between turns. A turn

1. appends the user's message to the transcript;
2. NLU classifies the message and extracts slots, off the transcript (nlu.py);
3. updates the topic stack and the slots (the dialogue layer, model-free: `Dialogue.decide`),
   and asks the policy (DM) for an action;
4. appends the assistant's reply (NLG): template text, or free generation on the transcript;
   a turn without generation then encodes the transcript (a prefill). Either way one request
   per turn reads the transcript, on the session, so only the tokens since the last turn are
   computed ("incremental encoding"); with the prefix cache off, each recomputes it all.

Every request of the turn is metered: prompt tokens, tokens served by the prefix cache, tokens
computed (= prompt - cached), split into the transcript's and NLU's, and the turn's latency.
"""

from __future__ import annotations

import string
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda import lang
from pagoda.dialogue.nlu import NLU, Understanding
from pagoda.dialogue.policy import Action, DialogueState, Policy
from pagoda.dialogue.slots import Slot
from pagoda.dialogue.topics import Frame, Topic, TopicStack


@dataclass
class Usage:
    """One request's token counts (`channel`: transcript or nlu)."""

    channel: str
    prompt_tokens: int
    cached_tokens: int

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


class _Metered:
    """A lang backend that records every request's token counts into `sink` (swapped per turn)."""

    def __init__(self, backend, channel: str) -> None:
        self.backend, self.channel = backend, channel
        self.sink: list[Usage] = []

    def generate(self, prompt: str, g, **kwargs):
        return self._record(self.backend.generate(prompt, g, **kwargs))

    def prefill(self, prompt: str, **kwargs):
        return self._record(self.backend.prefill(prompt, **kwargs))

    def role_markers(self, role: str) -> tuple[str, str]:
        return self.backend.role_markers(role)

    def _record(self, result):
        if result is not None:  # a backend whose prefill reports nothing
            self.sink.append(Usage(self.channel, result.prompt_tokens, result.cached_tokens))
        return result


@dataclass
class Turn:
    index: int
    user: str
    reply: str
    intent: str
    slots: dict[str, Any]  # what NLU extracted from this message
    action: str
    stack: list[str]  # topic names after the turn, bottom first
    events: list[tuple[str, str]]  # what happened to the topic stack this turn
    usage: list[Usage] = field(default_factory=list)
    latency_s: float = 0.0

    def tokens(self, channel: str | None = None, what: str = "computed_tokens") -> int:
        return sum(getattr(u, what) for u in self.usage if channel is None or u.channel == channel)

    @property
    def prompt_tokens(self) -> int:
        return self.tokens(what="prompt_tokens")

    @property
    def cached_tokens(self) -> int:
        return self.tokens(what="cached_tokens")

    @property
    def computed_tokens(self) -> int:
        return self.tokens()

    @property
    def transcript_tokens(self) -> int:
        """The longest transcript prompt of the turn: the conversation's length so far."""
        return max((u.prompt_tokens for u in self.usage if u.channel == "transcript"), default=0)


class Dialogue:
    """A dialogue application: its topics, intents (each with example messages for NLU), policy
    (DM: code or a `StateTable`) and system prompt. `backend` is a `pagoda.lang` backend
    (`lang.Engine` or `lang.Endpoint`); None builds one that can only `decide` (no model)."""

    def __init__(self, backend, *, topics: Sequence[Topic], intents: Mapping[str, Sequence[str]], policy: Policy,
                 system_prompt: str = "", domain: str = "a customer", name: str = "dialogue",
                 reply_tokens: int = 48) -> None:
        self.backend = backend
        self.topics = {t.name: t for t in topics}
        self.policy = policy
        self.system_prompt = system_prompt
        self.reply_tokens = reply_tokens
        self.name = f"{name}-{uuid.uuid4().hex[:8]}"
        for topic in topics:
            unknown = [i for i in topic.intents if i not in intents]
            if unknown:
                raise ValueError(f"topic {topic.name!r} opens on unknown intents {unknown}")
        slots: dict[str, Slot] = {}
        for topic in topics:
            for slot in topic.slots:
                slots.setdefault(slot.name, slot)
        self.nlu = NLU(intents, list(slots.values()), domain=domain, name=self.name)

    def topic_for(self, intent: str) -> Topic | None:
        for topic in self.topics.values():
            if intent in topic.intents:
                return topic
        return None

    def session(self, session_id: str | None = None) -> DialogueSession:
        return DialogueSession(self, session_id or f"{self.name}.{uuid.uuid4().hex[:12]}")

    def prepare(self) -> None:
        """Encode the NLU prompts once now (pinned for the dialogue's life), so that no turn pays
        for them."""
        self.nlu.prepare(self.backend)

    def close(self) -> None:
        """Let the NLU prompts' pinned prefixes go (the sessions release their own)."""
        release = getattr(self.backend, "release_session", None)
        if release is not None:
            for sid in self.nlu.session_ids():
                release(sid)

    # -- the dialogue layer and DM, model-free --------------------------------------------------
    def update(self, state: DialogueState, nlu: Understanding) -> None:
        """Move the topic stack for `nlu` and fill the current topic's slots."""
        stack, topic = state.stack, self.topic_for(nlu.intent)
        state.resumed = None
        current = stack.current
        if current is not None and current.topic.digression and topic is not current.topic:
            stack.pop()  # the user left the digression: what it interrupted resumes
            state.resumed = stack.current
        if topic is not None and (stack.current is None or stack.current.topic is not topic):
            if stack.find(topic.name) is not None:
                state.resumed = stack.resume(topic.name)
            else:
                stack.push(topic)
        if state.resumed is not None and state.resumed is not stack.current:
            state.resumed = None
        if stack.current is not None:
            names = {s.name for s in stack.current.topic.slots}
            for name, value in nlu.slots.items():
                if name in names:
                    stack.current.fill(name, value)

    def decide(self, state: DialogueState, nlu: Understanding) -> list[tuple[Action, Frame | None, bool]]:
        """The DM step: update the state, ask the policy. An action that completes a topic which
        had interrupted another asks the policy again for the resumed topic (with no new input),
        so the reply goes back to it. Returns the steps as (action, its frame, resumed?)."""
        self.update(state, nlu)
        frame = state.current
        action = self.policy(state, nlu)
        steps = [(action, frame, frame is not None and state.resumed is frame)]
        if action.complete and frame is not None:
            state.stack.pop()
            state.resumed = state.current
            if state.current is not None:
                steps.append((self.policy(state, Understanding("")), state.current, True))
        return steps

    def render(self, action: Action, frame: Frame | None, resumed: bool = False) -> tuple[str, bool, str]:
        """An action's reply as (text before, generate?, text after); templates are formatted
        with `frame`'s slot values, and a resumed topic's `resume_text` comes first."""
        values = _Values(frame.values if frame is not None else {})
        parts = []
        if resumed and frame is not None and frame.topic.resume_text:
            parts.append(frame.topic.resume_text)
        if action.say:
            parts.append(string.Formatter().vformat(action.say, (), values))
        if action.ask and frame is not None:
            missing = frame.missing()
            slot = frame.topic.slot(action.ask) if isinstance(action.ask, str) else (missing[0] if missing else None)
            if slot is not None:
                parts.append(slot.question)
        then = string.Formatter().vformat(action.then, (), values) if action.then else ""
        return " ".join(parts), action.generate, then


class _Values(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


@lang.function
def dialogue_turn(s: lang.ProgramState, session: DialogueSession, message: str) -> Turn:
    """One turn, as one program run on the session's transcript `s`."""
    d = session.dialogue
    s += lang.user(message)
    nlu = d.nlu.understand(session._nlu, message)  # off the transcript
    steps = d.decide(session.state, nlu)  # DM
    items: list[Any] = []  # NLG: template text and free generation, in one assistant turn
    for action, frame, resumed in steps:
        before, generate, after = d.render(action, frame, resumed)
        items += [before] if before else []
        items += [lang.gen(f"reply{len(items)}", max_tokens=d.reply_tokens, regex=action.regex,
                           stop=None if action.regex else "\n")] if generate else []
        items += [after] if after else []
    s += lang.assistant(*[part for i, item in enumerate(items) for part in ([" "] if i else []) + [item]])
    if not any(isinstance(item, lang.Gen) for item in items):
        # No generation read the transcript this turn: encode it now (on the session, so only
        # the tokens since the last turn are computed), keeping the conversation's KV current.
        session._transcript.prefill(s.text(), session_id=s.session_id)
    return Turn(session.state.turn, message, "", nlu.intent, dict(nlu.slots), "+".join(a.name for a, _, _ in steps),
                session.stack.names(), [])


class DialogueSession:
    """One conversation: its transcript (a lang ProgramState on the session), its topic stack,
    and the record of its turns."""

    def __init__(self, dialogue: Dialogue, session_id: str) -> None:
        self.dialogue = dialogue
        self.session_id = session_id
        self.state = DialogueState(TopicStack())
        self.turns: list[Turn] = []
        self._transcript = _Metered(dialogue.backend, "transcript")
        self._nlu = _Metered(dialogue.backend, "nlu")
        self._lock = threading.Lock()
        self.transcript = lang.ProgramState(self._transcript, session_id=session_id)
        if dialogue.system_prompt:
            self.transcript += lang.system(dialogue.system_prompt)

    @property
    def stack(self) -> TopicStack:
        return self.state.stack

    def say(self, message: str) -> Turn:
        """The user says `message`; returns the turn (its reply, NLU result, stack, usage)."""
        with self._lock:
            usage: list[Usage] = []
            self._transcript.sink = self._nlu.sink = usage
            self.state.turn = len(self.turns) + 1
            events_before = len(self.stack.events)
            before = len(self.transcript.text())
            start = time.perf_counter()
            turn = dialogue_turn(self.transcript, self, message)
            text = self.transcript.text()  # waits for the reply
            turn.latency_s = time.perf_counter() - start
            turn.usage = usage
            turn.events = self.stack.events[events_before:]
            turn.reply = self._reply_of(text[before:])
            self.turns.append(turn)
            return turn

    def _reply_of(self, turn_text: str) -> str:
        open_, close = self.dialogue.backend.role_markers("assistant")
        return turn_text.rsplit(open_, 1)[-1].removesuffix(close).strip()

    def text(self) -> str:
        return self.transcript.text()

    def close(self) -> None:
        """End the conversation: its pinned prefix becomes ordinary cache."""
        release = getattr(self.dialogue.backend, "release_session", None)
        if release is not None:
            release(self.session_id)
        self.transcript.close()
