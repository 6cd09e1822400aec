"""What the benchmarks send: synthetic prompts of given (or sampled) token lengths, or a JSONL file.

Synthetic prompts are token-exact when a tokenizer is at hand: they are made of "word" tokens
(a space and ASCII letters, such as `` the``) that each encode back to themselves, so the text
encodes to exactly the requested number of tokens, counting the special tokens the tokenizer adds.
Without a tokenizer the prompts are random token ids (for servers that take them, like pagoda and
vLLM), or words whose token count is only estimated.

JSONL: one object a line, with ``prompt`` (text or token ids) or ``prompt_token_ids``, and
optionally ``output_len`` (or ``max_tokens``); ShareGPT-style lines (``conversations`` with
``from``/``value``, or ``messages`` with ``role``/``content``) use the first user turn as the
prompt and, when a tokenizer is given, the token length of the reply that follows as output length.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pagoda.loader import catalog
from pagoda.tokenizer import Tokenizer, tokenizer_of

_FALLBACK_WORDS = ("the", "model", "serves", "a", "request", "with", "tokens", "and", "every", "batch")


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens, as the model sees them (estimated when no tokenizer was available)
    output_len: int


def sample_lengths(n: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """n lengths drawn uniformly from [mean * (1 - r), mean * (1 + r)], at least 1 (r = 0: all equal)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


class PromptMaker:
    """Builds text prompts that a tokenizer encodes to an exact number of tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
        self.words = self._word_tokens(tokenizer)

    @staticmethod
    def _word_tokens(tokenizer: Tokenizer) -> list[int]:
        words = []
        for tid in range(tokenizer.vocab_size):
            text = tokenizer.decode([tid], skip_special_tokens=True)
            if len(text) >= 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
                if tokenizer.encode(text, add_special_tokens=False) == [tid]:
                    words.append(tid)
        return words

    def make(self, num_tokens: int, rng: random.Random) -> tuple[str, int]:
        """(text, its token count with special tokens); the count is num_tokens when the vocabulary allows."""
        body = max(1, num_tokens - self.num_special)
        if len(self.words) >= 8:
            ids = [rng.choice(self.words) for _ in range(body)]
            text = self.tokenizer.decode(ids)
            if self.tokenizer.encode(text, add_special_tokens=False) == ids:
                return text, body + self.num_special
        # A vocabulary without such words: decode random ids and re-encode until the length settles.
        ids = [rng.randrange(self.tokenizer.vocab_size) for _ in range(body)]
        for _ in range(8):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:body]
            if len(ids) == body:
                break
            ids += [rng.randrange(self.tokenizer.vocab_size) for _ in range(body - len(ids))]
        text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text))


@functools.lru_cache(maxsize=4)
def prompt_maker(tokenizer: Tokenizer) -> PromptMaker:
    """The PromptMaker of a tokenizer, built once (scanning the vocabulary takes about a second)."""
    return PromptMaker(tokenizer)


def random_requests(num_prompts: int, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                    tokenizer: Tokenizer | None = None, vocab_size: int | None = None, as_text: bool = True,
                    seed: int = 0) -> list[SampleRequest]:
    """Synthetic requests: prompt and output lengths sampled around input_len / output_len.

    as_text=True gives text prompts (token-exact with a tokenizer); as_text=False gives token ids
    drawn from the vocabulary (tokenizer's, or vocab_size), which are exact by construction.
    """
    rng = random.Random(seed)
    in_lens = sample_lengths(num_prompts, input_len, range_ratio, rng)
    out_lens = sample_lengths(num_prompts, output_len, range_ratio, rng)
    if not as_text:
        vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
        if not vocab:
            raise ValueError("token-id prompts need a tokenizer or a vocabulary size")
        lo, hi = (100, vocab - 100) if vocab > 1000 else (0, vocab - 1)  # keep clear of special tokens
        return [SampleRequest([rng.randint(lo, hi) for _ in range(n)], n, m) for n, m in zip(in_lens, out_lens)]
    if tokenizer is None:
        return [SampleRequest(" ".join(rng.choice(_FALLBACK_WORDS) for _ in range(n)), n, m) for n, m in zip(in_lens, out_lens)]
    maker = prompt_maker(tokenizer)
    requests = []
    for n, m in zip(in_lens, out_lens):
        text, count = maker.make(n, rng)
        requests.append(SampleRequest(text, count, m))
    return requests


def _first_turns(turns: list[dict]) -> tuple[str | None, str | None]:
    """(first user message, the assistant reply right after it) of a ShareGPT / OpenAI conversation."""
    user_roles, bot_roles = {"human", "user"}, {"gpt", "assistant", "bot", "model"}
    for i, turn in enumerate(turns):
        role = turn.get("from", turn.get("role"))
        if role in user_roles:
            text = turn.get("value", turn.get("content"))
            reply = None
            if i + 1 < len(turns) and turns[i + 1].get("from", turns[i + 1].get("role")) in bot_roles:
                reply = turns[i + 1].get("value", turns[i + 1].get("content"))
            return text, reply
    return None, None


def load_jsonl(path: str | Path, *, output_len: int, tokenizer: Tokenizer | None = None,
               num_prompts: int | None = None) -> list[SampleRequest]:
    """Requests from a JSONL file (see the module docstring for the accepted shapes)."""
    requests: list[SampleRequest] = []
    path = Path(path)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            prompt = row.get("prompt", row.get("prompt_token_ids", row.get("text")))
            out = row.get("output_len", row.get("max_tokens"))
            turns = row.get("conversations", row.get("messages"))
            if prompt is None and isinstance(turns, list):
                prompt, reply = _first_turns(turns)
                if out is None and reply is not None and tokenizer is not None:
                    out = len(tokenizer.encode(reply, add_special_tokens=False))
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_len = len(prompt)
            elif isinstance(prompt, str):
                prompt_len = len(tokenizer.encode(prompt)) if tokenizer is not None else len(prompt.split())
            else:
                raise ValueError(f"{path}:{lineno}: no prompt (expected 'prompt', 'prompt_token_ids' or a conversation)")
            requests.append(SampleRequest(prompt, prompt_len, max(1, int(out or output_len))))
            if num_prompts is not None and len(requests) >= num_prompts:
                break
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def load_tokenizer(name: str | None) -> Tokenizer | None:
    """pagoda's tokenizer of a model named as `--model` takes it (a directory, a .gguf, a catalog name).

    Returns None for names that are none of these (a served model name such as "tiny"), and never
    downloads from the Hugging Face hub.
    """
    if not name:
        return None

    if not Path(name).expanduser().exists() and catalog.resolve_catalog_name(name) is None:
        return None
    return tokenizer_of(name)


def add_cli_args(p: argparse.ArgumentParser, *, num_prompts_help: str, seed: bool = True) -> None:
    """The options that say which requests to make (shared by `bench throughput` and `bench serve`)."""
    g = p.add_argument_group("requests")
    g.add_argument("--num-prompts", type=int, default=None, help=num_prompts_help)
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens (the mean when sampled)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (the mean when sampled)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="sample lengths uniformly from [len*(1-r), len*(1+r)] (default 0: all equal)")
    g.add_argument("--dataset", default=None, help="a JSONL file of prompts instead of synthetic ones")
    if seed:
        g.add_argument("--seed", type=int, default=0)


def build_requests(ns: argparse.Namespace, tokenizer: Tokenizer | None, num_prompts: int, *,
                   as_text: bool) -> list[SampleRequest]:
    """The requests that the options of `add_cli_args` describe."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if ns.dataset:
        return load_jsonl(ns.dataset, output_len=ns.output_len, tokenizer=tokenizer, num_prompts=num_prompts)
    return random_requests(num_prompts, ns.input_len, ns.output_len, range_ratio=ns.range_ratio,
                           tokenizer=tokenizer, as_text=as_text, seed=ns.seed)
