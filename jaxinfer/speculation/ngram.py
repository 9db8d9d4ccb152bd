"""Prompt-lookup drafting: propose the tokens that followed the last occurrence of the request's latest
n-gram earlier in its own context (prompt and output). No model runs; it pays off where the output
repeats its context (code edits, quoting, summaries that reuse phrases).

A request's NgramIndex grows with its tokens: each appended token indexes the n-grams it closes, so a
proposal is max_n - min_n + 1 dictionary lookups whatever the context's length. A speculating step
waits for the host's plan, so a search over the whole context on every step of every request would
sit on the step's critical path.
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """A growing token sequence and, for each n in [min_n, max_n], where every n-gram of it last ended."""

    def __init__(self, max_n: int = 4, min_n: int = 2, tokens: Iterable[int] = ()):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n={min_n} <= max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # _ends[n - min_n][gram]: the end (exclusive) of gram's latest occurrence before the suffix.
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._followed: set[int] = set()  # tokens that occur somewhere with a token after them
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        # The n-grams ending here stop being the suffix: from now on they are earlier occurrences.
        tokens, end = self.tokens, len(self.tokens)
        for n, ends in enumerate(self._ends, self.min_n):
            if end >= n:
                ends[tuple(tokens[end - n :])] = end
        if tokens:
            self._followed.add(tokens[-1])
        tokens.append(int(token))

    def may_match_after_next(self) -> bool:
        """Whether propose() can find anything once one more token, whatever it is, is appended. Every
        n-gram it could match then (n >= min_n >= 2) holds the current last token just before the new
        one, so that token must have occurred before with a token after it. False is exact: a serving
        loop need not wait for the token in flight to know that a step drafts nothing."""
        return self.min_n < 2 or (bool(self.tokens) and self.tokens[-1] in self._followed)

    def propose(self, num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens continuing the sequence: the longest n (max_n down to min_n) whose
        last n tokens occurred before, at its most recent earlier occurrence; [] when none did.

        A match of n tokens drafts at most n + 1: a short match continues less often, and each draft
        widens the step that verifies it. SmolLM2's chat answers on a Zen 4 EPYC accept 1.2 of four
        drafts after a 2-token match and 3.4 after a 4-token one, and a fourth draft costs more than
        a third (docs/benchmarks.md)."""
        tokens, length = self.tokens, len(self.tokens)
        if num_drafts <= 0 or length <= self.min_n:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self._ends[n - self.min_n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + min(num_drafts, n + 1)]
        return []
