"""Streaming detokenization: turn generated token ids into text one id at a time.

Decoding each token on its own is wrong in two ways. A character can span several tokens (byte-fallback
tokens, byte-level BPE pieces of an emoji or CJK character), and decoding a lone piece yields U+FFFD. And
some decoders treat the first token of a sequence specially (SentencePiece strips the space marker "▁" of the
first piece when the model adds a dummy prefix), so a token decoded alone can lose its leading space.

So the detokenizer decodes a short window: the last chunk of tokens already turned into text (the context)
plus the tokens not yet emitted. The new text is whatever the window decodes to beyond the context's own text.
Trailing U+FFFD characters are held back while they may still be an incomplete character. Each call decodes
O(window) tokens, and the window restarts after every clean boundary, so the cost per token is O(1) amortised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 character is at most 4 bytes, so in valid text a character stays incomplete for at most 3 tokens.
# Past this many tokens without a clean boundary the trailing U+FFFD is genuinely invalid output (or tokens
# that decode to nothing), and the detokenizer emits it rather than let the window grow without bound.
MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Feed ids with `add`, collect the text it returns, call `flush` at the end.

    The concatenation of everything returned equals `decode(all_ids)` for decoders that are concatenative
    across clean character boundaries (byte-level BPE, SentencePiece), and no returned piece ends in a
    character that more tokens could still complete.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        if not callable(decode):
            raise ValueError(f"decode must be callable, got {type(decode).__name__}")
        self._decode = decode
        self._window: list[int] = []  # context tokens followed by pending tokens
        self._context_len = 0  # window[:context_len] is the context, already emitted
        self._context_chars = 0  # len(decode(window[:context_len]))
        self._emitted_pending_chars = 0  # chars of the pending tokens' text already emitted
        self._pieces: list[str] = []  # emitted text, joined lazily by `text`

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Adds one generated id; returns the newly completed text (possibly "")."""
        self._window.append(token_id)
        try:
            window_text = self._decode(self._window)
        except Exception:
            self._window.pop()  # a rejected id (e.g. outside the vocabulary) leaves the stream unchanged
            raise
        num_pending = len(self._window) - self._context_len
        incomplete = window_text.endswith(REPLACEMENT_CHAR)
        if num_pending >= MAX_PENDING_TOKENS:
            incomplete = False  # give up waiting: the bytes are invalid, not merely incomplete
        # Text that is final: everything but a trailing run of U+FFFD that later bytes may still complete.
        final_text = window_text.rstrip(REPLACEMENT_CHAR) if incomplete else window_text
        start = self._context_chars + self._emitted_pending_chars
        new_text = final_text[start:]
        self._emitted_pending_chars += len(new_text)
        if not incomplete and (len(window_text) > self._context_chars or num_pending >= MAX_PENDING_TOKENS):
            # Clean boundary with visible text: the pending tokens become the next context. Their own text is
            # decoded again because a decoder may render a sequence's first token differently (dummy prefix).
            self._window = self._window[self._context_len :]
            self._context_len = len(self._window)
            self._context_chars = len(self._decode(self._window))
            self._emitted_pending_chars = 0
        return self._emit(new_text)

    def flush(self) -> str:
        """Returns whatever is left (held-back bytes decode to U+FFFD here) and resets the window."""
        window_text = self._decode(self._window) if self._window else ""
        new_text = window_text[self._context_chars + self._emitted_pending_chars :]
        self._window, self._context_len, self._context_chars, self._emitted_pending_chars = [], 0, 0, 0
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        if new_text:
            self._pieces.append(new_text)
        return new_text
