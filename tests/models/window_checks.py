"""Shared by the sliding-window tests (test_gemma3.py, test_sliding_window.py): transformers'
greedy continuation of token-id prompts, and pagoda's, compared token for token."""

from __future__ import annotations

import torch

from pagoda import LLM, SamplingParams

MAX_TOKENS = 12


def prompt(length: int, seed: int = 0) -> list[int]:
    """``length`` token ids of the tiny vocabulary (no special tokens: ids 3..383)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (length,), generator=g).tolist()


def reference(ref, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their logprobs, one prompt at a time."""
    results = []
    with torch.no_grad():
        for ids in prompts:
            full = ref.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=0)[0]
            logprobs = torch.log_softmax(ref(full.unsqueeze(0)).logits[0].float(), dim=-1)
            new = full[len(ids):]
            results.append((new.tolist(), logprobs[len(ids) - 1 : -1].gather(1, new.unsqueeze(1)).squeeze(1).tolist()))
    return results


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_matches(outs, expected, atol: float = 1e-4) -> None:
    for out, (tokens, logprobs) in zip(outs, expected, strict=True):
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt of {len(out.prompt_token_ids)} tokens"
        ours = [pos[t].logprob for t, pos in zip(got.token_ids, got.logprobs)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs)) < atol


def track_peak_blocks(monkeypatch) -> list[int]:
    """The most KV pool blocks in use at once from now on (``peak[0]``), seen at every allocation."""
    from pagoda.core.block_pool import BlockPool

    peak = [0]
    allocate = BlockPool.allocate

    def tracked(self, n):
        blocks = allocate(self, n)
        peak[0] = max(peak[0], self.num_used_blocks)
        return blocks

    monkeypatch.setattr(BlockPool, "allocate", tracked)
    return peak
