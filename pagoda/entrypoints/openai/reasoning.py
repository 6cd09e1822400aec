"""Reasoning output (`--reasoning-parser`): a thinking model writes its reasoning between
`<think>` and `</think>` before the answer; the parser splits one choice's text, as it streams,
into reasoning and content, so the APIs can send the reasoning apart (chat's
`reasoning_content`, Responses' reasoning items, Messages' thinking blocks, Ollama's `thinking`)
and parse tool calls from the content only.

Where the output starts matters: templates that think by default end the prompt with `<think>`
(DeepSeek-R1, Qwen3's thinking models), so the output starts inside the reasoning and has only the
closing tag; a prompt ending with `</think>` (thinking turned off by `enable_thinking: false`)
starts in the content. Otherwise the output is reasoning only if it opens with `<think>`, except
for `deepseek_r1`, whose models may leave the opening tag out: their output starts inside.
A constrained output (a JSON schema, a tool_choice, a regex) is what its constraint says: it
starts in the content, and is split only where the constraint itself writes the tags.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.entrypoints.openai.tool_formats import partial_suffix


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    assume_inside: bool = False  # the output starts inside the reasoning unless the prompt says otherwise
    open: str = "<think>"
    close: str = "</think>"

    def splitter(self, prompt_tail: str, constrained: bool) -> "ReasoningSplitter":
        """A splitter for one choice of a prompt ending in `prompt_tail`."""
        tail = prompt_tail.rstrip()
        inside = not constrained and not tail.endswith(self.close) and (tail.endswith(self.open) or self.assume_inside)
        return ReasoningSplitter(self, inside)


REASONING_PARSERS = {
    "deepseek_r1": ReasoningFormat("deepseek_r1", assume_inside=True),
    "qwen3": ReasoningFormat("qwen3"),
    "think": ReasoningFormat("think"),  # the generic form: <think>...</think> first, if at all
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]


class ReasoningSplitter:
    """One choice's text, piece by piece → (reasoning, content) pieces. Text that may be the
    start of a tag is held back until it is known; `reasoning_tokens` counts the tokens of the
    pieces read while in the reasoning (the piece that closes it included)."""

    def __init__(self, fmt: ReasoningFormat, inside: bool) -> None:
        self.fmt = fmt
        self.state = "inside" if inside else "start"  # start → inside → after, or start → after
        self.buffer = ""
        self.strip_next = False  # the whitespace after </think> is not content
        self.strip_thought = inside  # nor is the whitespace after <think> reasoning
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int = 0, finished: bool = False) -> tuple[str, str]:
        counted = self.state == "inside"
        self.buffer += text
        reasoning, content = [], []
        while self.buffer or finished:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(self.fmt.open):
                    self.buffer, self.state = stripped[len(self.fmt.open):], "inside"
                    counted = self.strip_thought = True
                    continue
                if not finished and self.fmt.open.startswith(stripped):
                    break  # "<thi": wait for the rest
                self.state = "after"
            elif self.state == "inside":
                if self.strip_thought:  # whitespace, and an opening tag the prompt already wrote
                    self.buffer = self.buffer.lstrip()
                    if self.buffer.startswith(self.fmt.open):
                        self.buffer = self.buffer[len(self.fmt.open):]
                        continue
                    if not finished and self.fmt.open.startswith(self.buffer):
                        break  # nothing yet, or "<thi"
                    self.strip_thought = False
                end = self.buffer.find(self.fmt.close)
                if end >= 0:
                    reasoning.append(self.buffer[:end])
                    self.buffer, self.state, self.strip_next = self.buffer[end + len(self.fmt.close):], "after", True
                    continue
                keep = 0 if finished else partial_suffix(self.buffer, self.fmt.close)
                reasoning.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            else:
                piece = self.buffer.lstrip() if self.strip_next else self.buffer
                self.strip_next = self.strip_next and not piece
                content.append(piece)
                self.buffer = ""
                break
        if counted:
            self.reasoning_tokens += num_tokens
        return "".join(reasoning), "".join(content)
