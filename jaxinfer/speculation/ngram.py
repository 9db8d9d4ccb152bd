"""Prompt-lookup drafting: propose the tokens that followed the last occurrence of the request's latest
n-gram earlier in its own context (prompt and output). No model runs; it pays off where the output
repeats its context (code edits, quoting, summaries that reuse phrases)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Most tokens searched back from the end: the search is host work on every step of every request.
SEARCH_WINDOW = 4096


def propose_ngram(tokens: Sequence[int], num_drafts: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Up to `num_drafts` tokens continuing `tokens`: the longest n (max_n down to min_n) whose last
    n tokens occurred before, at its most recent earlier occurrence; [] when none did."""
    if num_drafts <= 0 or len(tokens) <= min_n:
        return []
    context = np.asarray(tokens[-SEARCH_WINDOW:], np.int64)
    length = len(context)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = context[-n:]
        # Windows starting at 0 .. length - n - 1 (the suffix itself excluded), compared at once.
        windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start : start + num_drafts].tolist()
    return []
