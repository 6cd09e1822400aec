"""One choice's generated text → what the APIs send: reasoning (`--reasoning-parser`), then
tool calls parsed from the content only (a `<tool_call>` the model writes while reasoning is not
a call), then the content. Streamed, as chat deltas (`reasoning_content`, `content`,
`tool_calls`); whole, as a `ParsedChoice`. Chat completions, the Responses API, Anthropic's
Messages and Ollama's chat all read their output through it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagoda.entrypoints.openai.reasoning import ReasoningSplitter
from pagoda.entrypoints.openai.response_parts import Sample
from pagoda.entrypoints.openai.tool_calls import ToolCall, ToolCallStream, ToolChoice
from pagoda.outputs import CompletionOutput


@dataclass
class ParsedChoice:
    reasoning: str | None  # None: no reasoning parser, or the model wrote none
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    reasoning_tokens: int = 0
    split: bool = False  # a reasoning parser read it


class ChoiceParser:
    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolChoice | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.stream = ToolCallStream(tools) if tools else None

    @property
    def num_calls(self) -> int:
        return self.stream.num_calls if self.stream else 0

    @property
    def reasoning_tokens(self) -> int:
        return self.reasoning.reasoning_tokens if self.reasoning else 0

    def feed(self, text: str, num_tokens: int, finished: bool) -> dict:
        """The chat delta for the text generated since the last call ({} while it is held back)."""
        thought, content = self.reasoning.feed(text, num_tokens, finished) if self.reasoning else ("", text)
        delta = self.stream.feed(content, finished) if self.stream else ({"content": content} if content else {})
        return {"reasoning_content": thought, **delta} if thought else delta

    def whole(self, pieces: list[tuple[str, int]]) -> ParsedChoice:
        """A finished choice from its pieces (text, tokens), as they were generated."""
        if self.reasoning is None:
            text, thought = "".join(p for p, _ in pieces), None
        else:
            split = [self.reasoning.feed(p, n) for p, n in pieces] + [self.reasoning.feed("", 0, finished=True)]
            thought = "".join(r for r, _ in split) or None
            text = "".join(c for _, c in split)
        content, calls = self.tools.parse(text) if self.tools else (text, [])
        return ParsedChoice(thought, content, calls, self.reasoning_tokens, self.reasoning is not None)


@dataclass
class StreamedChoice:
    """One choice as it streams: gathered (`sample`), with the prompt tokens served from cache."""

    sample: Sample = field(default_factory=Sample)
    cached: int = 0

    async def gather(self, outputs: AsyncIterator) -> Sample:
        """The whole choice of `outputs` (Serving.run_all's, one prompt), for an answer that does
        not stream."""
        async for _, out in outputs:
            self.cached = out.num_cached_tokens
            for c in out.outputs:
                self.sample.add(c)
        return self.sample

    async def deltas(self, outputs: AsyncIterator, parser: ChoiceParser) -> AsyncIterator[tuple[CompletionOutput, dict]]:
        """Each engine delta of `outputs` (Serving.run_all's, one prompt) with its parsed chat delta."""
        async for _, out in outputs:
            self.cached = out.num_cached_tokens
            for c in out.outputs:
                self.sample.add(c)
                yield c, parser.feed(c.text, len(c.token_ids), c.finish_reason is not None)
