"""Prompt lookup (n-gram) drafts: text that repeats (quoting the prompt, editing code, lists)
continues as it did before. No model runs; a miss proposes nothing."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """The (up to) ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, trying n from ``n_max`` down to ``n_min``; [] when none recurs."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: length - 1], n)  # window i ends before the last token
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
