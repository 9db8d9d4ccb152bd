"""Structured output: a per-request token mask from a grammar (llguidance), applied on the device.

A request's StructuredOutput (JSON object, JSON Schema, regex or Lark grammar) becomes an llguidance
LLMatcher. Before each step that samples for the request, the scheduler asks the matcher which tokens
may come next: a bitmask `[ceil(vocab / 32)] int32` (bit i of word w allows token 32 * w + i), which
the sampling step applies to the logits on the device. The sampled token is then fed back to the
matcher. Because the mask of step n+1 needs the token of step n, a constrained request joins a decode
step only once its previous token is known (scheduler.py), and the serving loop reads each step before
planning the next while such a request runs.

JSON is generated compactly (", " and ": " separators, no free whitespace): a model that may emit
whitespace between tokens can also emit it forever, and the output parses the same.
"""

from __future__ import annotations

import functools
import json

import llguidance
import llguidance.numpy
import numpy as np

from jaxinfer.request import RequestError, StructuredKind, StructuredOutput

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

ALLOW_ALL = -1  # a mask word with every bit set


def mask_words(vocab_size: int) -> int:
    """int32 words of one token mask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allow_all(rows: int, num_words: int) -> np.ndarray:
    """[rows, num_words] masks that allow every token."""
    return np.full((rows, num_words), ALLOW_ALL, np.int32)


def token_allowed(mask: np.ndarray, token_id: int) -> bool:
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


@functools.lru_cache(maxsize=256)
def _grammar(kind: StructuredKind, spec: str) -> str:
    if kind is StructuredKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind is StructuredKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)
    if kind is StructuredKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    return llguidance.LLMatcher.grammar_from_lark(spec)


class _TokenBytes:
    """llguidance's TokenizerWrapper protocol over a tokenizer that lists each token's bytes."""

    def __init__(self, tokenizer):
        self.eos_token_id = tokenizer.eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.token_bytes()
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_bos=False)


class GrammarCompiler:
    """Builds matchers for one tokenizer (its token table is built once: ~1 s for a 262k vocabulary)."""

    @staticmethod
    def supports(tokenizer) -> bool:
        """Whether the tokenizer lists its tokens (real tokenizers do; test stand-ins may not)."""
        return bool(tokenizer.eos_ids) and (
            hasattr(tokenizer, "hf_tokenizer_json") or hasattr(tokenizer, "token_bytes")
        )

    def __init__(self, tokenizer):
        self.vocab_size = tokenizer.vocab_size
        self.num_words = mask_words(self.vocab_size)
        eos = list(tokenizer.eos_ids)
        hf_json = tokenizer.hf_tokenizer_json() if hasattr(tokenizer, "hf_tokenizer_json") else None
        source = hf_json if hf_json is not None else llguidance.TokenizerWrapper(_TokenBytes(tokenizer))
        self._tokenizer = llguidance.LLTokenizer(source, n_vocab=self.vocab_size, eos_token=eos)
        self._executor = llguidance.LLExecutor()

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A fresh matcher; RequestError if the constraint does not compile (a bad schema or regex)."""
        try:
            if constraint.kind is StructuredKind.JSON_SCHEMA:
                json.loads(constraint.spec)
            grammar = _grammar(constraint.kind, constraint.spec)
        except ValueError as e:  # JSONDecodeError included
            raise RequestError(f"the {constraint.kind} is invalid: {e}", "structured_output") from None
        m = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"the {constraint.kind} is invalid: {m.get_error()}", "structured_output")
        return Matcher(m)

    def fill_masks(self, rows: list[tuple[Matcher, int]], masks: np.ndarray) -> None:
        """Writes each matcher's next-token mask into row `index` of masks [rows, num_words] int32."""
        if rows:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m._m, i) for m, i in rows], masks)

    def allowed_mask(self, matcher: Matcher) -> np.ndarray:
        masks = np.zeros((1, self.num_words), np.int32)
        self.fill_masks([(matcher, 0)], masks)
        return masks[0]


class Matcher:
    """One request's grammar state; fed every output token in order."""

    def __init__(self, m: llguidance.LLMatcher):
        self._m = m

    def accept(self, token_id: int) -> bool:
        """Advances by one sampled token; False if the grammar does not allow it."""
        return self._m.consume_token(token_id)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: nothing (but end of sequence) may follow."""
        return self._m.is_stopped()
