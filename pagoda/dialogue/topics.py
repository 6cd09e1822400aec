"""Topics and the topic stack: what the conversation is about, and what it was about before.

A `Topic` is a kind of conversation (a booking, a question about the menu) with the intents that
open it and the slots it fills. A `Frame` is one topic in progress: its slot values and status.
The `TopicStack` keeps the frames: a new topic is pushed on top and interrupts the one below; when
it finishes (popped), the interrupted one resumes where it was, its slots intact.

A *digression* topic lasts only while the user stays on it: the first turn whose intent is not
one of its own ends it and resumes the topic it interrupted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.dialogue.slots import Slot


@dataclass
class Topic:
    name: str
    intents: Sequence[str] = ()  # the user intents that open (or continue) this topic
    slots: Sequence[Slot] = ()
    digression: bool = False
    resume_text: str = ""  # said when the topic resumes after an interruption ("Back to your booking.")

    def slot(self, name: str) -> Slot:
        for slot in self.slots:
            if slot.name == name:
                return slot
        raise KeyError(f"topic {self.name!r} has no slot {name!r}")


@dataclass
class Frame:
    """One topic in progress."""

    topic: Topic
    values: dict[str, Any] = field(default_factory=dict)
    status: str = "active"  # active | interrupted | done | abandoned

    @property
    def name(self) -> str:
        return self.topic.name

    def fill(self, name: str, value: Any) -> None:
        """Set a slot (validated against its schema: jsonschema's ValidationError if it does not fit)."""
        self.topic.slot(name).validate(value)
        self.values[name] = value

    def missing(self) -> list[Slot]:
        return [s for s in self.topic.slots if s.name not in self.values]

    @property
    def filled(self) -> bool:
        return not self.missing()

    def __repr__(self) -> str:
        return f"Frame({self.name!r}, {self.values!r}, {self.status})"


class TopicStack:
    """Frames, bottom first; `events` logs every change as (kind, topic name):
    push, interrupt, pop (finished), abandon, resume."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.events: list[tuple[str, str]] = []
        self.closed: list[Frame] = []  # popped frames (done or abandoned), oldest first

    @property
    def current(self) -> Frame | None:
        return self.frames[-1] if self.frames else None

    def push(self, topic: Topic) -> Frame:
        """Start `topic` on top; the current topic (if any) is interrupted."""
        if self.current is not None:
            self.current.status = "interrupted"
            self.events.append(("interrupt", self.current.name))
        frame = Frame(topic)
        self.frames.append(frame)
        self.events.append(("push", topic.name))
        return frame

    def pop(self, status: str = "done") -> Frame:
        """Finish the current topic; the one it interrupted (if any) resumes, slots intact."""
        if not self.frames:
            raise IndexError("pop from an empty topic stack")
        frame = self.frames.pop()
        frame.status = status
        self.closed.append(frame)
        self.events.append(("pop" if status == "done" else status.removesuffix("ed"), frame.name))
        if self.current is not None:
            self.current.status = "active"
            self.events.append(("resume", self.current.name))
        return frame

    def find(self, name: str) -> Frame | None:
        """The topmost frame of topic `name` on the stack."""
        for frame in reversed(self.frames):
            if frame.name == name:
                return frame
        return None

    def resume(self, name: str) -> Frame:
        """Go back to the interrupted topic `name`: the frames above it are abandoned."""
        frame = self.find(name)
        if frame is None:
            raise KeyError(f"no topic {name!r} on the stack")
        while self.current is not frame:
            self.pop(status="abandoned")
        return frame

    def names(self) -> list[str]:
        return [f.name for f in self.frames]

    def __len__(self) -> int:
        return len(self.frames)

    def __iter__(self):
        return iter(self.frames)

    def __repr__(self) -> str:
        return f"TopicStack({self.names()})"
