"""Stand-ins for tests of the serving layer: a hand-computable `MockEngine` and a tiny `FakeTokenizer`.

MockEngine is arithmetic, so every expected token can be worked out by hand. With `vocab_size=10`,
a prompt [4, 7] and `seed=2`:
  prefill  -> first token  (7 + 1 + 2) % 10 = 0
  decode   -> (0 + 1 + 2) % 10 = 3, then 6, then 9, ...
A token in `sampling.stop_token_ids` ends the request with FINISH_STOP (the token is returned), the
`max_tokens`-th token ends it with FINISH_LENGTH, and so does reaching `max_seq_len` tokens.
`MockEngine.reference_tokens` is the same rule as a plain loop, for tests to compare against.

The engine keeps a token-id "KV cache" of `num_pages` pages and checks the contract it is driven with:
every chunk and decode position is written through the page table it is given, and before sampling,
the request's whole history read back through its page table must equal the tokens it should hold
(the last chunk's `prompt_token_ids`, then each sampled token). Wrong pages, a prefix-cache hit on the
wrong page, a page freed while in use, positions that skip or repeat: all raise, so scheduler bugs
surface in tests. It also checks distinct slots per prefill and chunk sizes.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxinfer.engine import (
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    DecodeBatch,
    Engine,
    PendingStep,
    PrefillChunk,
    StepOutput,
)
from jaxinfer.request import MAX_TOP_LOGPROBS, SamplingParams
from jaxinfer.structured_output import token_allowed

# --------------------------------------------------------------------------------------------------
# MockEngine
# --------------------------------------------------------------------------------------------------


def next_mock_token(last_token: int, sampling: SamplingParams, vocab_size: int) -> int:
    """The MockEngine's whole "model": the seed shifts the sequence so per-slot state mix-ups show."""
    return (last_token + 1 + sampling.seed) % vocab_size


def mock_logprob(token: int) -> float:
    """The MockEngine's log-probability of a token (a fixed function, so tests can check it arrives)."""
    return -((token % 7) + 1) / 8


def _first_allowed(token: int, mask: np.ndarray | None, vocab_size: int) -> int:
    """With a structured-output mask, the first token from `token` on (cyclically) that it allows."""
    if mask is None:
        return token
    for step in range(vocab_size):
        t = (token + step) % vocab_size
        if token_allowed(mask, t):
            return t
    raise ValueError("the token mask allows nothing")


@dataclasses.dataclass
class _MockSlot:
    active: bool = False
    last_token: int = 0
    num_generated: int = 0
    sampling: SamplingParams | None = None
    history: list[int] = dataclasses.field(default_factory=list)  # every token the request holds


class _MockPending(PendingStep):
    def __init__(self, output: StepOutput, ready_at: float, engine: MockEngine, is_decode: bool):
        self._output = output
        self._ready_at = ready_at
        self._engine = engine
        self._is_decode = is_decode
        self._read = False

    def result(self) -> StepOutput:
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if not self._read:
            self._read = True
            with self._engine._lock:
                self._engine._num_unread_decodes -= self._is_decode
        return self._output


class MockEngine(Engine):
    """An arithmetic Engine (see the module docstring) with an optional per-step device time.

    step_delay_s: each prefill or decode "runs" this long after the previous one ends, like a device
        queue; `result()` sleeps until then, dispatch returns at once.
    fail_at_decode: raise RuntimeError on this decode dispatch (1-based), to test fail-fast paths.
    """

    def __init__(
        self,
        *,
        num_slots: int = 4,
        max_seq_len: int = 64,
        max_prefill_chunk: int = 8,
        vocab_size: int = 32,
        page_size: int = 4,
        num_pages: int | None = None,
        step_delay_s: float = 0.0,
        fail_at_decode: int | None = None,
        max_draft_tokens: int = 0,
        draft_heads_depth: int = 0,
        heads_unsure: bool = False,
    ):
        if num_slots <= 0 or max_seq_len <= 0 or max_prefill_chunk <= 0 or vocab_size <= 1:
            raise ValueError(f"{num_slots=}, {max_seq_len=}, {max_prefill_chunk=}, {vocab_size=} must be > 0")
        self._num_slots = num_slots
        self._max_seq_len = max_seq_len
        self._max_prefill_chunk = max_prefill_chunk
        self._page_size = page_size
        # By default as much memory as num_slots full-length requests, plus the null page.
        self._num_pages = num_pages or num_slots * -(-max_seq_len // page_size) + 1
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.fail_at_decode = fail_at_decode
        self._max_draft_tokens = max_draft_tokens
        self._draft_heads_depth = draft_heads_depth
        self.heads_unsure = heads_unsure  # the heads are sure of nothing: every draft -1
        self._slots = [_MockSlot() for _ in range(num_slots)]
        self._kv = np.full((self._num_pages, page_size), -1, np.int64)  # token id at each position
        self._lock = threading.Lock()
        self._device_free_at = 0.0
        self._num_unread_decodes = 0
        # Counters and logs for tests.
        self.num_decode_steps = 0
        self.num_prefill_calls = 0
        self.num_prefill_tokens = 0
        self.max_unread_decodes = 0  # >1: a decode was dispatched before the previous one was read
        self.prefill_log: list[tuple[tuple[int, int, int, bool], ...]] = []  # (slot, start, len, last)
        self.decode_log: list[tuple[int, ...]] = []  # slots listed in each decode step
        self.draft_log: list[dict[int, tuple[int, ...]]] = []  # each decode step's drafts per slot
        self.heads_log: list[tuple[int, ...]] = []  # the slots each decode step's heads propose for

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def max_prefill_chunk(self) -> int:
        return self._max_prefill_chunk

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def max_draft_tokens(self) -> int:
        return self._max_draft_tokens

    @property
    def draft_heads_depth(self) -> int:
        return self._draft_heads_depth

    def _empty_output(self, width: int = 1, heads: bool = False) -> StepOutput:
        n, k = self._num_slots, MAX_TOP_LOGPROBS
        return StepOutput(
            tokens=np.zeros((n, width), np.int32),
            num_tokens=np.zeros(n, np.int32),
            done=np.zeros(n, bool),
            reason=np.zeros(n, np.int32),
            logprobs=np.zeros((n, width), np.float32),
            top_ids=np.zeros((n, width, k), np.int32),
            top_logprobs=np.zeros((n, width, k), np.float32),
            drafts=np.full((n, self._draft_heads_depth), -1, np.int32) if heads else None,
        )

    def _propose(self, out: StepOutput, slot: int) -> None:
        """The mock draft heads: the true continuation, except that every third draft is off by one
        (so verification accepts some drafts and rejects others)."""
        if out.drafts is None or self.heads_unsure:
            return
        s, last = self._slots[slot], self._slots[slot].last_token
        for i in range(self._draft_heads_depth):
            last = next_mock_token(last, s.sampling, self.vocab_size)
            out.drafts[slot, i] = (last + (i % 3 == 2)) % self.vocab_size

    def _dispatch(self, output: StepOutput, *, is_decode: bool) -> _MockPending:
        with self._lock:
            now = time.monotonic()
            self._device_free_at = max(now, self._device_free_at) + self.step_delay_s
            self._num_unread_decodes += is_decode
            self.max_unread_decodes = max(self.max_unread_decodes, self._num_unread_decodes)
            return _MockPending(output, self._device_free_at, self, is_decode)

    def _where(self, page_ids: Sequence[int], position: int) -> tuple[int, int]:
        index = position // self._page_size
        if index >= len(page_ids):
            raise ValueError(f"position {position} has no page ({len(page_ids)} pages given)")
        page = int(page_ids[index])
        if not 0 < page < self._num_pages:
            raise ValueError(f"position {position} maps to page {page}, not a usable page")
        return page, position % self._page_size

    def _write(self, page_ids: Sequence[int], start: int, tokens: Sequence[int]) -> None:
        for i, token in enumerate(tokens):
            self._kv[self._where(page_ids, start + i)] = token

    def _check_history(self, page_ids: Sequence[int], history: Sequence[int]) -> None:
        held = [int(self._kv[self._where(page_ids, p)]) for p in range(len(history))]
        if held != list(history):
            raise ValueError(f"the pages hold {held}, the request has {list(history)}")

    def _sample_into(self, out: StepOutput, slot: int, mask: np.ndarray | None = None) -> int:
        """Samples the slot's next token into its next output column; returns it."""
        s = self._slots[slot]
        if s.sampling is None:
            raise RuntimeError(f"slot {slot} samples before any prompt was written")
        token = next_mock_token(s.last_token, s.sampling, self.vocab_size)
        token = _first_allowed(token, mask, self.vocab_size)
        j = int(out.num_tokens[slot])
        out.logprobs[slot, j] = mock_logprob(token)
        alternatives = [(token + i) % self.vocab_size for i in range(MAX_TOP_LOGPROBS)]
        out.top_ids[slot, j] = alternatives
        out.top_logprobs[slot, j] = [mock_logprob(t) - i for i, t in enumerate(alternatives)]
        s.last_token = token
        s.num_generated += 1
        s.history.append(token)
        reason = FINISH_NONE
        if token in s.sampling.stop_token_ids:
            reason = FINISH_STOP
        elif s.num_generated >= s.sampling.max_tokens or len(s.history) >= self._max_seq_len:
            reason = FINISH_LENGTH
        out.tokens[slot, j], out.num_tokens[slot] = token, j + 1
        if reason != FINISH_NONE:
            out.done[slot], out.reason[slot] = True, reason
            s.active = False
        return token

    def prefill(self, chunks: Sequence[PrefillChunk]) -> PendingStep:
        slots = [c.slot for c in chunks]
        if not chunks or len(set(slots)) != len(slots):
            raise ValueError(f"prefill needs chunks on distinct slots, got {slots=}")
        out = self._empty_output(heads=self._draft_heads_depth > 0)
        self.num_prefill_calls += 1
        self.prefill_log.append(tuple((c.slot, c.start, len(c.token_ids), c.is_last) for c in chunks))
        for c in chunks:
            if not 0 <= c.slot < self._num_slots:
                raise ValueError(f"{c.slot=} out of range")
            n = len(c.token_ids)
            if not 0 < n <= self._max_prefill_chunk:
                raise ValueError(f"chunk of {n} tokens, {self._max_prefill_chunk=}")
            if c.start + n > self._max_seq_len:
                raise ValueError(f"chunk ends at {c.start + n} > {self._max_seq_len=}")
            self._write(c.page_ids, c.start, c.token_ids)
            self.num_prefill_tokens += n
            s = self._slots[c.slot] = _MockSlot()  # a chunk means the slot's last request is gone
            if c.is_last:
                fill = [int(t) for t in c.prompt_token_ids]
                if len(fill) != c.start + n or fill[c.start :] != [int(t) for t in c.token_ids]:
                    raise ValueError("prompt_token_ids must end with the last chunk's tokens")
                self._check_history(c.page_ids, fill)
                s.sampling, s.last_token, s.active = c.sampling, fill[-1], True
                s.num_generated, s.history = c.num_generated, fill
                self._sample_into(out, c.slot, c.token_mask)
                if c.drafting:
                    self._propose(out, c.slot)
        return self._dispatch(out, is_decode=False)

    def decode(self, batch: DecodeBatch) -> PendingStep:
        self.num_decode_steps += 1
        if self.fail_at_decode is not None and self.num_decode_steps >= self.fail_at_decode:
            raise RuntimeError(f"MockEngine: injected failure at decode step {self.num_decode_steps}")
        verify = batch.drafts is not None
        if verify and not 0 < batch.drafts.shape[1] <= self._max_draft_tokens:
            raise ValueError(f"{batch.drafts.shape[1]} drafts per row, {self._max_draft_tokens=}")
        heads = verify and self._draft_heads_depth > 0
        out = self._empty_output(batch.drafts.shape[1] + 1 if verify else 1, heads=heads)
        listed = tuple(int(i) for i in np.flatnonzero(batch.positions >= 0))
        self.decode_log.append(listed)
        proposing = tuple(i for i in listed if heads and (batch.drafting is None or batch.drafting[i]))
        self.heads_log.append(proposing)
        self.draft_log.append(
            {slot: tuple(int(d) for d in batch.drafts[slot] if d >= 0) for slot in listed} if verify else {}
        )
        for slot in listed:
            s = self._slots[slot]
            if not s.active:
                continue
            position = int(batch.positions[slot])
            if position != len(s.history) - 1:
                raise ValueError(f"slot {slot} decodes at {position}, its request holds {len(s.history)}")
            drafts = [int(d) for d in batch.drafts[slot]] if verify else []
            drafts = drafts[: drafts.index(-1)] if -1 in drafts else drafts
            self._write(batch.page_table[slot], position, [s.last_token, *drafts])  # rejected ones too
            self._check_history(batch.page_table[slot], s.history)
            mask = None if batch.token_mask is None else batch.token_mask[slot]
            if mask is not None and drafts:
                raise ValueError(f"slot {slot} is constrained and has drafts")
            # Greedy verification: each draft the "model" agrees with is output, then one more token.
            for draft in [*drafts, None]:
                token = self._sample_into(out, slot, mask)
                if token != draft or not s.active:
                    break
            if slot in proposing:
                self._propose(out, slot)
        return self._dispatch(out, is_decode=True)

    def reference_tokens(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        """The tokens this engine produces for one request, computed by a plain loop."""
        tokens: list[int] = []
        last, length = int(prompt_token_ids[-1]), len(prompt_token_ids)
        while True:
            last = next_mock_token(last, sampling, self.vocab_size)
            tokens.append(last)
            length += 1
            if last in sampling.stop_token_ids:
                return tokens
            if len(tokens) >= sampling.max_tokens or length >= self._max_seq_len:
                return tokens


# --------------------------------------------------------------------------------------------------
# FakeTokenizer
# --------------------------------------------------------------------------------------------------

_SPECIALS = ("<pad>", "<bos>", "<eos>", "<end_of_turn>")
# Byte pieces after the specials: printable ASCII and newline, a few words, and two characters whose
# UTF-8 bytes are split across two tokens each ("é" = c3|a9, "😀" = f09f|9880), so a detokenizer
# must hold back half a character.
_PIECES: tuple[bytes, ...] = (
    tuple(bytes([c]) for c in range(32, 127))
    + (b"\n", b"hello", b" world", b"the ")
    + (b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98\x80")
)


class FakeDetokenizer:
    """Incremental UTF-8-safe detokenizer over FakeTokenizer pieces (the IncrementalDetokenizer API)."""

    def __init__(self, tokenizer: FakeTokenizer):
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        piece = self._tokenizer.piece_bytes(token_id, skip_special=True)
        new = self._decoder.decode(piece, final=False)
        self.text += new
        return new

    def flush(self) -> str:
        new = self._decoder.decode(b"", final=True)
        self.text += new
        return new


class FakeTokenizer:
    """A byte-piece tokenizer over a ~110-token vocabulary implementing the jaxinfer Tokenizer interface.

    Ids 0-3 are specials (<pad>, <bos>, <eos>, <end_of_turn>); eos_ids = (2, 3). encode() is greedy
    longest match over UTF-8 bytes and raises ValueError for characters outside the vocabulary.
    The chat template renders "role: content\\n" per message and "assistant: " as generation prompt.
    """

    def __init__(self, *, add_bos: bool = True, has_chat_template: bool = True):
        self._pieces: tuple[bytes, ...] = tuple(s.encode() for s in _SPECIALS) + _PIECES
        self.vocab_size = len(self._pieces)
        self.num_special = len(_SPECIALS)
        self.bos_id: int | None = 1
        self.eos_ids: tuple[int, ...] = (2, 3)
        self.add_bos = add_bos
        self.has_chat_template = has_chat_template
        self._piece_to_id = {p: i for i, p in enumerate(self._pieces) if i >= self.num_special}
        self._max_piece = max(len(p) for p in self._piece_to_id)

    def piece_bytes(self, token_id: int, *, skip_special: bool) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"{token_id=} outside [0, {self.vocab_size})")
        if token_id < self.num_special and skip_special:
            return b""
        return self._pieces[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id < self.num_special

    def token_bytes(self) -> list[bytes]:
        return list(self._pieces)

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        data, ids, i = text.encode(), [], 0
        while i < len(data):
            for n in range(min(self._max_piece, len(data) - i), 0, -1):
                token = self._piece_to_id.get(data[i : i + n])
                if token is not None:
                    ids.append(token)
                    i += n
                    break
            else:
                raise ValueError(f"FakeTokenizer cannot encode byte {data[i]:#x} of {text!r}")
        if self.add_bos if add_bos is None else add_bos:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        data = b"".join(self.piece_bytes(int(t), skip_special=skip_special) for t in ids)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        if not self.has_chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_bos=self.add_bos)

    def detokenizer(self) -> FakeDetokenizer:
        return FakeDetokenizer(self)

    def save(self, directory) -> None:
        raise NotImplementedError("FakeTokenizer is not saved")


class IdTokenizer:
    """For real engines with random weights: every id detokenises to "<id>" (so a stop string can target a
    known token) and there is no eos, so generation runs to max_tokens."""

    eos_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def detokenizer(self) -> IdDetokenizer:
        return IdDetokenizer()


class IdDetokenizer:
    def __init__(self):
        self.text = ""

    def add(self, token_id: int) -> str:
        piece = f"<{token_id}>"
        self.text += piece
        return piece

    def flush(self) -> str:
        return ""


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Polls `predicate` (a server's state seen from another thread) until it holds; AssertionError
    after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


# --------------------------------------------------------------------------------------------------
# Paged caches for tests of the model and engine
# --------------------------------------------------------------------------------------------------


def paged_cache_config(num_slots: int, max_len: int, *, page_size: int = 8, dtype: str = "float32"):
    """A CacheConfig whose pool holds `num_slots` requests of `max_len` positions (plus the null page)."""
    from jaxinfer.config import CacheConfig

    pages = num_slots * -(-max_len // page_size) + 1
    return CacheConfig(
        num_pages=pages, page_size=page_size, max_len=max_len, num_slots=num_slots, dtype=dtype
    )


@functools.cache
def _jitted_forward():
    import jax

    from jaxinfer.models.transformer import forward

    return jax.jit(forward, static_argnames=("config", "kernels"))


def jit_forward(*args, **kwargs):
    """`models.transformer.forward`, compiled once per shape: run op by op, one forward pass compiles
    hundreds of small XLA programs."""
    return _jitted_forward()(*args, **kwargs)


def scattered_page_table(rows: int, pages_per_row: int, num_pages: int, seed: int = 0) -> np.ndarray:
    """[rows, pages_per_row] int32: distinct pages in a shuffled order (never the null page), so a model
    test reads through a page table that is not the identity."""
    if rows * pages_per_row > num_pages - 1:
        raise ValueError(f"{rows} x {pages_per_row} pages do not fit in {num_pages - 1} usable pages")
    pages = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[: rows * pages_per_row]
    return pages.reshape(rows, pages_per_row).astype(np.int32)
