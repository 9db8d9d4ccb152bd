"""The device contract between the scheduler and a model: prefill chunks into rows, decode every row.

The KV cache is a pool of pages (kv_cache.py) owned by the host: the scheduler allocates pages,
keeps each request's page table and length, and passes them with every call. The engine keeps only
what the device needs across steps for each decode *slot* (a row of the batch): the last sampled
token, the sampling settings, the stop conditions and an `active` flag.

One request's life on the engine:
  1. `prefill([PrefillChunk(slot, tokens, start, page_ids, ...)])` writes the chunk's KV entries into
     the request's pages (a long prompt in several chunks; `start` is where the chunk begins, which is
     past the prompt's cached prefix when pages were shared). The last chunk samples the first output
     token and makes the slot active.
  2. `decode(DecodeBatch(positions, page_table))` samples one more token for every slot the host lists
     whose slot is still active on the device. The device checks stop token ids and max_tokens itself,
     so steps can be dispatched back to back without waiting; a slot whose token is `done` goes
     inactive. A request the host ends early (stop string, cancel, preemption) is simply left out of
     the next batch.

Results come back as `Pending*` handles: calling `.result()` blocks until that step's small packed
array is on the host, so the caller can dispatch step n+1 before reading step n.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.request import SamplingParams
from jaxinfer.speculation.step_costs import StepCosts


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """A piece of a request's tokens, written into its pages at positions [start, start + len(token_ids))."""

    slot: int
    token_ids: Sequence[int]
    start: int
    sampling: SamplingParams
    # The request's pages in position order, covering at least [0, start + len(token_ids)).
    page_ids: Sequence[int]
    # The last chunk samples the next output token and activates the slot.
    is_last: bool = True
    # Every token id the request has seen (prompt and output so far; penalties); only read when is_last.
    prompt_token_ids: Sequence[int] = ()
    # Output tokens already produced: a preempted request recomputes its prompt and output and goes on
    # from there (max_tokens and the sampling key count from it).
    num_generated: int = 0
    # [ceil(vocab / 32)] int32: the tokens the sampled token may be (structured output); None: any.
    token_mask: np.ndarray | None = None
    # Whether the engine's draft heads propose the request's first drafts (StepOutput.drafts; -1 when
    # not): a request that drafts with them. Only read when is_last.
    drafting: bool = True


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step's rows, from the scheduler. Arrays are indexed by slot.

    positions:  [num_slots] int32: the position of each slot's input token (its request's length so
                far); -1 leaves the slot out of the step.
    page_table: [num_slots, pages] int32: each slot's pages in position order, covering its position
                (and its drafts' positions); entries past a request's pages are the null page
                (kv_cache.NULL_PAGE).
    token_mask: [num_slots, ceil(vocab / 32)] int32 bitmasks of the tokens each slot may sample
                (structured output; a row of -1 allows all), or None when no slot is constrained.
    drafts:     [num_slots, k] int32 draft tokens to verify after each slot's input token (speculative
                decoding), -1 past a slot's drafts; None: a plain step, one token per slot. A slot with
                drafts outputs between 1 and k + 1 tokens (StepOutput.num_tokens).
    drafting:   [num_slots] bool: the slots whose next drafts the engine's draft heads propose
                (StepOutput.drafts; -1 elsewhere); None: every listed slot. With no slot drafting and
                no drafts, the step is a plain one and the heads do not run.
    """

    positions: np.ndarray
    page_table: np.ndarray
    token_mask: np.ndarray | None = None
    drafts: np.ndarray | None = None
    drafting: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One step, on the host. Arrays are indexed by slot; T is the most tokens a slot can output in
    the step (1, or k + 1 when drafts were verified).

    tokens:     [num_slots, T] the tokens each slot output, in order (meaningful up to num_tokens).
    num_tokens: [num_slots] how many; 0 where the slot was not active at this step.
    done:       the last token ended the request on the device: a stop token id, max_tokens, or the
                context end.
    reason:     why it ended (FINISH_* codes below) where done.
    logprobs, top_ids, top_logprobs: each token's log-probability [num_slots, T] float32 and the
                MAX_TOP_LOGPROBS most likely tokens [num_slots, T, MAX_TOP_LOGPROBS] (ids int32,
                float32); meaningful only for slots whose request asked for log-probabilities.
    drafts:     [num_slots, depth] the draft heads' proposals for the tokens after the last one
                (speculation.draft_heads), or None when the engine has no heads.
    """

    tokens: np.ndarray
    num_tokens: np.ndarray
    done: np.ndarray
    reason: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    drafts: np.ndarray | None = None

    @property
    def valid(self) -> np.ndarray:
        """[num_slots] bool: the slot was active at this step."""
        return self.num_tokens > 0

    @property
    def token(self) -> np.ndarray:
        """[num_slots]: each slot's last token of the step."""
        return self.tokens[np.arange(len(self.tokens)), np.maximum(self.num_tokens - 1, 0)]


FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


class PendingStep(abc.ABC):
    @abc.abstractmethod
    def result(self) -> StepOutput:
        """Blocks until the step's results are on the host."""


class Engine(abc.ABC):
    """What the scheduler drives. Implementations: `jax_engine.JaxEngine`, `testing.MockEngine`."""

    @property
    @abc.abstractmethod
    def num_slots(self) -> int:
        """Decode rows: most requests running at once."""

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """Most tokens (prompt plus output) one request may hold."""

    @property
    @abc.abstractmethod
    def max_prefill_chunk(self) -> int:
        """Most tokens one PrefillChunk may carry (the largest prefill bucket)."""

    @property
    @abc.abstractmethod
    def page_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def num_pages(self) -> int:
        """Pages in the KV pool, the null page included."""

    @abc.abstractmethod
    def prefill(self, chunks: Sequence[PrefillChunk]) -> PendingStep:
        """Writes each chunk into its pages. Chunks must name distinct slots.

        The returned step has one entry per slot: for each chunk with is_last, the first sampled token
        (valid=True, done set if that token already ends the request); all other entries invalid.
        """

    @abc.abstractmethod
    def decode(self, batch: DecodeBatch) -> PendingStep:
        """Samples one token for every listed slot that is active on the device (with drafts: verifies
        them, and outputs the accepted ones and one more); a slot whose token is `done` becomes
        inactive."""

    @property
    def max_draft_tokens(self) -> int:
        """Most drafts a DecodeBatch may carry per slot; 0: the engine does not verify drafts."""
        return 0

    @property
    def draft_heads_depth(self) -> int:
        """Drafts the engine's draft heads propose per step (StepOutput.drafts); 0: no heads."""
        return 0

    def warmup(self) -> float:
        """Compiles every program the engine will run; returns the seconds it took."""
        return 0.0

    # What its verification steps cost against plain ones (measured at warm-up); None: not measured.
    step_costs: StepCosts | None = None
