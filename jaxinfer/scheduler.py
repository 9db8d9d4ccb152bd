"""Continuous-batching policy: admission by KV memory, chunked prefill, decode rows, preemption, stops.

Pure Python: no JAX, no threads, no clock. The orchestrator (and `generate`) call it under one lock.
One engine step is

    out = scheduler.schedule()                     # decide: prefill chunks, the decode batch
    dispatch(engine, out)                          # engine.prefill / engine.decode (results come later)
    scheduler.update_from_output(out, prefill_result, decode_result)   # credit tokens, find stops

The scheduler is the one owner of each request's length and pages: the KV cache is a pool of pages
(page_pool.PagePool), each request holds a list of them (its page table) and a count of positions
written (`num_computed`), and every call to the engine carries those. A request moves
WAITING -> PREFILLING -> RUNNING -> FINISHED, and back to WAITING when preempted:
  - Admission (FIFO) needs a free decode slot (`num_slots` rows) and pages for all of its tokens to
    prefill; a prompt whose first pages are prefix-cached takes those pages and starts after them.
  - Each decode step a running request needs a page for its next position. When the pool is empty,
    the newest request is preempted: its pages are freed (full ones stay cached) and it goes back to
    the front of the queue with its output so far, to be recomputed (prompt and output prefilled
    again, mostly from the prefix cache) and continued; its stream loses and repeats nothing.
  - A request that finishes on the host (stop string, length, cancel) frees its slot and pages at once
    and is simply left out of the next decode batch.

Pipelining: the orchestrator reads step n's results only after dispatching step n+1, so step n+1 may
carry a token for a request that finished or was preempted in step n (or whose slot has since been
handed to another request). Each SchedulerOutput therefore snapshots which request, in which
incarnation (`epoch`, bumped by preemption), owned each slot when it was dispatched; a token is
credited only to that owner and only while it is still in that incarnation, else dropped. Pages freed
while a dispatched step still writes into them are safe: the device runs steps in dispatch order, so a
page's next owner writes after, and reads only what it wrote itself or what the prefix cache vouches
for (full pages whose tokens were known when cached).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from jaxinfer.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    DecodeBatch,
    Engine,
    PendingStep,
    PrefillChunk,
    StepOutput,
)
from jaxinfer.kv_cache import NULL_PAGE
from jaxinfer.page_pool import PageHash, PagePool, extend_page_hashes
from jaxinfer.request import FinishReason, RequestError, SamplingParams
from jaxinfer.speculation.config import SpeculationConfig, SpeculativeMethod
from jaxinfer.speculation.gate import BatchGate, DraftGate
from jaxinfer.speculation.ngram import NgramIndex
from jaxinfer.speculation.step_costs import StepCosts
from jaxinfer.structured_output import GrammarCompiler, Matcher, allow_all


class QueueFull(Exception):
    """The waiting queue is at max_queue; the caller should retry later (gRPC RESOURCE_EXHAUSTED)."""


class IncrementalDetokenizer(Protocol):
    def add(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILLING = "prefilling"  # holds a slot; prompt chunks still to write
    RUNNING = "running"  # last chunk dispatched; the device samples a token every decode step
    FINISHED = "finished"


class _StopStringText:
    """Detokenized text of one request with stop-string matching.

    Text that could be the start of a stop string is held back, so a client never sees part of a stop
    string that is later cut off. The returned text ends right before the first stop string.
    """

    def __init__(self, detokenizer: IncrementalDetokenizer, stop: Sequence[str]):
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        self._text = ""  # all text decoded so far
        self._num_emitted = 0  # characters of _text already returned

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (new text to emit, whether a stop string completed)."""
        self._text += self._detokenizer.add(token_id)
        return self._advance(final=False)

    def finish(self) -> str:
        self._text += self._detokenizer.flush()
        return self._advance(final=True)[0]

    def _advance(self, *, final: bool) -> tuple[str, bool]:
        hits = [i for s in self._stop if (i := self._text.find(s, self._num_emitted)) >= 0]
        if hits:
            end, matched = min(hits), True
            self._text = self._text[:end]
        else:
            end, matched = (len(self._text) if final else self._hold_back_end()), False
        new = self._text[self._num_emitted : end]
        self._num_emitted = end
        return new, matched

    def _hold_back_end(self) -> int:
        """End of the text that cannot be the beginning of a stop string."""
        text = self._text
        longest = max((len(s) for s in self._stop), default=1)
        for k in range(min(longest - 1, len(text) - self._num_emitted), 0, -1):
            if any(s.startswith(text[-k:]) for s in self._stop):
                return len(text) - k
        return len(text)


@dataclasses.dataclass(eq=False)
class SequenceState:
    """The scheduler's record of one request (compared by identity)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    text: _StopStringText | None
    matcher: Matcher | None = None  # structured output: the grammar state after output_token_ids
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Pages and positions, owned here and passed to the engine with every call.
    page_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # positions whose KV entries dispatched steps write
    num_cached_pages: int = 0  # leading pages already registered in the prefix cache
    # The tokens this incarnation prefills: the prompt, plus the output so far after a preemption.
    fill_token_ids: tuple[int, ...] = ()
    num_dispatched_outputs: int = 0  # output tokens that dispatched steps will have produced
    epoch: int = 0  # bumped by each preemption: tokens of steps dispatched before it are dropped
    num_prefix_hit_tokens: int = 0  # prompt tokens taken from the prefix cache at the last admission
    admission_order: int = 0  # preemption takes the newest admitted first
    # Prefix-cache keys of the leading full pages of all_token_ids, extended as it grows (it only
    # grows, so a key once computed stays right, preemptions included).
    page_keys: list[PageHash] = dataclasses.field(default_factory=list)
    # Speculative decoding: the draft heads' latest proposal (after the last output token), the
    # drafted and accepted totals, and each drafter's adaptive switch.
    head_drafts: tuple[int, ...] = ()
    num_drafted: int = 0
    num_accepted: int = 0
    lookup_gate: DraftGate = dataclasses.field(default_factory=DraftGate)
    heads_gate: DraftGate = dataclasses.field(default_factory=DraftGate)
    lookup: NgramIndex | None = None  # prompt lookup over all_token_ids, made at its first draft

    @property
    def is_live(self) -> bool:
        return self.status is not RequestStatus.FINISHED

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_unread_outputs(self) -> int:
        """Output tokens of dispatched steps whose results are not read yet."""
        return self.num_dispatched_outputs - len(self.output_token_ids)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability and the most likely alternatives' (as many as asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (only requests with news appear)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # One per new token when the request asked for log-probabilities, else empty.
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    num_draft_tokens: int = 0  # speculative decoding, totals so far: tokens drafted and accepted
    num_accepted_tokens: int = 0


Owner = tuple[SequenceState, int]  # (request, epoch) at dispatch


@dataclasses.dataclass
class _News:
    """What one step brought one request, gathered before its RequestOutput is made."""

    seq: SequenceState
    tokens: list[int] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)

    def add_text(self, token: int) -> FinishReason | None:
        """Detokenises one token of the request (a stop token's text is output like any other, vLLM's
        rule; special tokens such as eos detokenise to nothing); STOP when a stop string completes."""
        new_text, stop_string_hit = self.seq.text.add(token)
        self.texts.append(new_text)
        return FinishReason.STOP if stop_string_hit else None

    def fields(self) -> dict:
        """The RequestOutput fields of what the step brought (Scheduler._output / _finish)."""
        return dict(
            new_tokens=tuple(self.tokens), new_text="".join(self.texts), new_logprobs=tuple(self.logprobs)
        )


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. The orchestrator applies it in field order: prefill, then decode."""

    step: int
    prefill_chunks: tuple[PrefillChunk, ...]
    decode_batch: DecodeBatch | None
    admitted_request_ids: tuple[str, ...]  # got a slot this step (for queue-time metrics)
    preempted_request_ids: tuple[str, ...]
    # Owner of each slot at dispatch: the only request that may be credited with that slot's token.
    prefill_owners: dict[int, Owner]  # slots whose last chunk runs this step
    decode_owners: dict[int, Owner]  # slots in the decode batch
    # Slots whose row verifies drafts, and how many: their advance is known only from the result.
    num_drafts: dict[int, int] = dataclasses.field(default_factory=dict)
    # Which drafter proposed each of those rows' drafts: NGRAM (prompt lookup) or HEADS.
    drafted_by: dict[int, SpeculativeMethod] = dataclasses.field(default_factory=dict)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefill_chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.prefill_chunks or self.decode_batch is not None)


class Scheduler:
    """FIFO admission by free slots and free KV pages, chunked prefill under a per-step token budget,
    preemption of the newest request when decode runs out of pages.

    num_slots, max_seq_len, max_prefill_chunk, page_size, num_pages: the engine's (engine.Engine).
    max_queue: most WAITING requests; add_request raises QueueFull beyond it.
    prefill_token_budget: most prompt tokens per step over all chunks (default max_prefill_chunk), so a
        long prompt is spread over several steps while running requests keep decoding every step.
    enable_prefix_caching: reuse full pages of earlier requests with the same prefix.
    detokenizer_factory: makes one IncrementalDetokenizer per request (for text and stop strings);
        None only if no request uses stop strings (outputs then carry no text).
    grammar_compiler: makes the matchers of requests with structured output (structured_output.py);
        None only if no request asks for one.
    speculation: how requests draft tokens for the engine to verify (None: never); draft_heads_depth:
        the engine's draft heads' drafts per step (Engine.draft_heads_depth).
    """

    def __init__(
        self,
        *,
        num_slots: int,
        max_seq_len: int,
        max_prefill_chunk: int,
        page_size: int,
        num_pages: int,
        max_queue: int,
        prefill_token_budget: int | None = None,
        enable_prefix_caching: bool = True,
        detokenizer_factory: Callable[[], IncrementalDetokenizer] | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        speculation: SpeculationConfig | None = None,
        draft_heads_depth: int = 0,
        step_costs: StepCosts | None = None,
    ):
        budget = max_prefill_chunk if prefill_token_budget is None else prefill_token_budget
        for name, value in [
            ("num_slots", num_slots),
            ("max_seq_len", max_seq_len),
            ("max_prefill_chunk", max_prefill_chunk),
            ("page_size", page_size),
            ("max_queue", max_queue),
            ("prefill_token_budget", budget),
        ]:
            if value <= 0:
                raise ValueError(f"{name}={value} must be > 0")
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.max_prefill_chunk = max_prefill_chunk
        self.page_size = page_size
        self.max_queue = max_queue
        self.prefill_token_budget = budget
        self.pool = PagePool(num_pages, enable_prefix_caching=enable_prefix_caching)
        self._detokenizer_factory = detokenizer_factory
        self._grammar = grammar_compiler
        self.speculation = speculation
        self._draft_heads_depth = draft_heads_depth
        # Measured by the engine; without them, speculation is judged per request only.
        self._step_costs = step_costs
        self._batch_gates: dict[int, BatchGate] = {}  # by the engine's row bucket (StepCosts.rows)
        if (
            speculation is not None
            and speculation.method is SpeculativeMethod.HEADS
            and not draft_heads_depth
        ):
            raise ValueError("speculation by draft heads needs an engine with draft heads")
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._requests: dict[str, SequenceState] = {}  # every live request, in arrival order
        self._slot_owner: list[SequenceState | None] = [None] * num_slots
        self._free_slots: list[int] = list(range(num_slots))  # kept sorted: lowest slot first
        self._pages_per_seq = -(-max_seq_len // page_size)
        self._page_table = np.full((num_slots, self._pages_per_seq), NULL_PAGE, np.int32)
        self._step = 0
        self._admissions = itertools.count()
        self._deferred_text: list[_News] = []  # update_from_output(defer_text=True) -> flush_text()
        # Counters for metrics (monotonic).
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of which accepted
        self.num_verify_rows = 0  # (step, request) pairs that verified drafts
        self.num_batch_plain_steps = 0  # decode steps the batch gate kept plain

    # ---- queries -----------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        return len(self._requests)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_running(self) -> int:
        return self.num_slots - len(self._free_slots)

    def num_tokens_held(self) -> int:
        return sum(r.num_computed for r in self._slot_owner if r is not None)

    def kv_cache_utilization(self) -> float:
        """Share of the usable pages that live requests hold."""
        return self.pool.num_used / self.pool.num_usable

    def has_work(self) -> bool:
        return bool(self._requests)

    def needs_results_first(self) -> bool:
        """Whether the next plan depends on the tokens of steps still in flight (_waits_for_tokens: a
        grammar's next mask, a drafter's next drafts), so the serving loop reads each step before
        planning the next."""
        speculating = self._speculation_on()
        return any(
            r.slot is not None and self._waits_for_tokens(r, speculating) for r in self._requests.values()
        )

    def get(self, request_id: str) -> SequenceState | None:
        return self._requests.get(request_id)

    def _pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    # ---- admission and finishing --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        matcher: Matcher | None = None,
    ) -> None:
        """Queues a request whose fields request.check_request accepted. Raises ValueError when the
        KV pool could never hold it, QueueFull when the queue is full.

        matcher: the request's grammar state, when the caller compiled it already (outside its lock);
        else it is compiled here from sampling.structured_output."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > self.max_seq_len:
            raise ValueError(f"{total} positions exceed max_seq_len={self.max_seq_len}")
        if self._pages_for(total) > self.pool.num_usable:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens + max_tokens={sampling.max_tokens} needs "
                f"{self._pages_for(total)} KV pages of {self.page_size} positions; the whole pool has "
                f"{self.pool.num_usable}"
            )
        if sampling.stop and self._detokenizer_factory is None:
            raise ValueError("stop strings need a detokenizer_factory")
        if sampling.structured_output is not None and self._grammar is None:
            raise RequestError("structured output is not served here", "structured_output")
        if sampling.speculative not in (None, SpeculativeMethod.OFF) and self.speculation is None:
            raise RequestError("this server runs without speculative decoding (--speculative)", "speculative")
        if sampling.speculative == SpeculativeMethod.HEADS and not self._draft_heads_depth:
            raise RequestError("speculative='heads': this server has no draft heads", "speculative")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
        text = None
        if self._detokenizer_factory is not None:
            text = _StopStringText(self._detokenizer_factory(), sampling.stop)
        if sampling.structured_output is not None and matcher is None:
            matcher = self._grammar.matcher(sampling.structured_output)
        seq = SequenceState(request_id, tuple(int(t) for t in prompt_token_ids), sampling, text, matcher)
        self._requests[request_id] = seq
        self._waiting.append(seq)

    def finish_request(self, request_id: str, reason: FinishReason) -> RequestOutput | None:
        """Ends a live request now (cancel, deadline, error); its slot and pages are free for the next step.

        Returns the request's final output, or None if it is not live (already finished: a no-op).
        """
        reason = FinishReason(reason)
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq.status is RequestStatus.WAITING:
            self._waiting.remove(seq)
        return self._finish(seq, reason, new_tokens=(), new_text="")

    def finish_all(self, reason: FinishReason) -> list[RequestOutput]:
        outputs = [self.finish_request(rid, reason) for rid in list(self._requests)]
        return [o for o in outputs if o is not None]

    def _finish(
        self,
        seq: SequenceState,
        reason: FinishReason,
        *,
        new_tokens: tuple[int, ...],
        new_text: str,
        new_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> RequestOutput:
        if seq.text is not None:
            new_text += seq.text.finish()
        self._cache_full_pages(seq)
        self._release(seq)
        seq.status, seq.finish_reason = RequestStatus.FINISHED, reason
        del self._requests[seq.request_id]
        return self._output(seq, new_tokens, new_text, new_logprobs)

    def _release(self, seq: SequenceState) -> None:
        """Gives back the request's slot and pages (last page first: its tail is evicted first)."""
        self.pool.free(seq.page_ids[::-1])
        seq.page_ids, seq.num_computed, seq.num_cached_pages = [], 0, 0
        if seq.slot is not None:
            self._slot_owner[seq.slot] = None
            self._page_table[seq.slot] = NULL_PAGE
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
            seq.slot = None

    def _preempt(self, seq: SequenceState) -> None:
        """Frees the request's slot and pages and requeues it first, to recompute and continue."""
        self._cache_full_pages(seq)
        self._release(seq)
        seq.status = RequestStatus.WAITING
        seq.epoch += 1
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    @staticmethod
    def _output(
        seq: SequenceState,
        new_tokens: tuple[int, ...],
        new_text: str,
        new_logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_prefix_hit_tokens,
            new_logprobs=new_logprobs,
            num_draft_tokens=seq.num_drafted,
            num_accepted_tokens=seq.num_accepted,
        )

    # ---- pages ------------------------------------------------------------------------------------

    def _cache_full_pages(self, seq: SequenceState) -> None:
        """Offers the prefix cache every page of `seq` that is full, written by a dispatched step and
        whose tokens the host knows (a decode step's input token is known only once it was read)."""
        known = min(seq.num_computed, len(seq.prompt_token_ids) + len(seq.output_token_ids))
        full = min(known // self.page_size, len(seq.page_ids))
        if full <= seq.num_cached_pages or not self.pool.enable_prefix_caching:
            return
        keys = self._page_keys(seq, full)
        for i in range(seq.num_cached_pages, full):
            self.pool.cache(seq.page_ids[i], keys[i])
        seq.num_cached_pages = full

    def _page_keys(self, seq: SequenceState, num_pages: int) -> list[PageHash]:
        """The keys of the first num_pages full pages of `seq`'s tokens."""
        if len(seq.page_keys) < num_pages:
            extend_page_hashes(seq.page_keys, seq.all_token_ids, self.page_size, num_pages)
        return seq.page_keys[:num_pages]

    def _fill_keys(self, seq: SequenceState) -> list[PageHash]:
        """Keys of the pages a prefill of `seq` may take from the cache: every full page but the one
        holding the last token, which is always computed (its logits sample the next token)."""
        return self._page_keys(seq, (len(seq.all_token_ids) - 1) // self.page_size)

    def _upcoming_keys(self, seq: SequenceState) -> list[PageHash]:
        """Keys of the pages a request being prefilled has yet to dispatch."""
        return self._fill_keys(seq)[seq.num_computed // self.page_size :]

    def _waits_for_prefix(self, seq: SequenceState, upcoming: set[PageHash]) -> bool:
        """Whether the first page `seq` would compute is one a request being prefilled computes anyway:
        admitted later, `seq` takes it from the cache instead of computing it twice (32 requests over
        one document arriving together prefill the document once)."""
        keys = self._fill_keys(seq)
        hits = self.pool.num_cached_prefix(keys)
        return hits < len(keys) and keys[hits] in upcoming

    def _admit(self, seq: SequenceState) -> bool:
        """Gives `seq` a slot and pages for every token it prefills, reusing prefix-cached pages;
        False (and nothing taken) when the pool cannot hold it now."""
        fill = seq.all_token_ids
        cached = self.pool.take_cached(self._fill_keys(seq))
        fresh = self.pool.allocate(self._pages_for(len(fill)) - len(cached))
        if fresh is None:
            self.pool.free(cached[::-1])
            return False
        self._waiting.popleft()
        seq.slot = self._free_slots.pop(0)
        self._slot_owner[seq.slot] = seq
        seq.status = RequestStatus.PREFILLING
        seq.fill_token_ids = fill
        seq.page_ids = cached + fresh
        seq.num_cached_pages = len(cached)
        seq.num_computed = len(cached) * self.page_size
        self._page_table[seq.slot, : len(seq.page_ids)] = seq.page_ids
        seq.num_prefix_hit_tokens = seq.num_computed if not seq.output_token_ids else 0
        if not seq.output_token_ids:  # a recomputation after preemption is not a cache query
            self.prefix_query_tokens += len(fill)
            self.prefix_hit_tokens += seq.num_computed
        return True

    def _grow(self, seq: SequenceState, position: int | None = None) -> bool:
        """Makes sure `seq` has pages up to `position` (default: num_computed, its next input), taking
        them from the pool one at a time; False if the pool ran out first."""
        position = seq.num_computed if position is None else position
        while position >= len(seq.page_ids) * self.page_size:
            page = self.pool.allocate(1)
            if page is None:
                return False
            self._page_table[seq.slot, len(seq.page_ids)] = page[0]
            seq.page_ids.extend(page)
        return True

    def _wants_decode(self, seq: SequenceState) -> bool:
        """Running, not yet at max_tokens counting the tokens already dispatched, and with every
        dispatched token read where its plan needs them (_waits_for_tokens: a grammar's mask, drafts)."""
        reads_first = self._waits_for_tokens(seq, self._speculation_on())
        return (
            seq.status is RequestStatus.RUNNING
            and seq.num_dispatched_outputs < seq.sampling.max_tokens
            and (not reads_first or seq.num_unread_outputs == 0)
        )

    # ---- speculative decoding -----------------------------------------------------------------------

    def _method(self, seq: SequenceState) -> SpeculativeMethod:
        if self.speculation is None:
            return SpeculativeMethod.OFF
        return SpeculativeMethod(seq.sampling.speculative or self.speculation.method)

    def _heads_draft(self, seq: SequenceState, speculating: bool) -> bool:
        """Whether `seq` drafts with the engine's draft heads now (they propose its next drafts), where
        `speculating` is _speculation_on() for this step."""
        return (
            speculating
            and self._drafts_allowed(seq)
            and self._method(seq) is SpeculativeMethod.HEADS
            and seq.heads_gate.is_open
        )

    def _waits_for_tokens(self, seq: SequenceState, speculating: bool) -> bool:
        """Whether planning `seq`'s next step needs the tokens of its steps in flight: its grammar's
        next mask follows from them, the heads' proposal comes with them, and prompt lookup continues
        them. Lookup alone does not wait where it cannot match whatever the one token in flight is
        (NgramIndex.may_match_after_next: the last known token never occurred before), so such steps
        go out while the previous one runs, as without speculation, and draft exactly as before."""
        if seq.matcher is not None or self._heads_draft(seq, speculating):
            return True
        if not (speculating and self._drafts_allowed(seq) and seq.lookup_gate.is_open):
            return False
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        # A verification in flight leaves num_computed behind (its advance comes with its result).
        one_plain_step_in_flight = seq.num_unread_outputs == 1 and seq.num_computed == known
        return not one_plain_step_in_flight or self._lookup(seq).may_match_after_next()

    def _lookup(self, seq: SequenceState) -> NgramIndex:
        """`seq`'s prompt-lookup index, grown to its known tokens (made on first use)."""
        if seq.lookup is None:
            config = self.speculation
            seq.lookup = NgramIndex(config.ngram_max, config.ngram_min, seq.prompt_token_ids)
        seq.lookup.extend(seq.output_token_ids[len(seq.lookup) - len(seq.prompt_token_ids) :])
        return seq.lookup

    def _drafts_allowed(self, seq: SequenceState) -> bool:
        """Whether `seq` may draft at all: speculation on for it and no grammar (its mask would have to
        follow every draft). Each drafter also has its own pause (DraftGate)."""
        return (
            self._method(seq) is not SpeculativeMethod.OFF
            and seq.sampling.num_draft_tokens != 0
            and seq.matcher is None
        )

    def _speculation_on(self) -> bool:
        """The batch switches: speculate only while few requests decode (SpeculationConfig.max_rows) and,
        over several, while verification steps give the batch more tokens than plain ones would in
        their time (_batch_gate)."""
        if self.speculation is None or self.num_running > self.speculation.max_rows:
            return False
        gate = self._batch_gate()
        return gate is None or gate.is_open

    def _batch_gate(self) -> BatchGate | None:
        """The gate of the row bucket the running requests' slots decode in, where several requests run
        and the engine measured that bucket's step costs (one request's own gates judge its drafts
        alone)."""
        if self._step_costs is None or self.num_running < 2:
            return None
        return self._gate_of(1 + max(slot for slot, seq in enumerate(self._slot_owner) if seq is not None))

    def _gate_of(self, slots: int) -> BatchGate | None:
        """The batch gate of the row bucket that a step over the first `slots` slots runs in, if measured."""
        rows = self._step_costs.rows(slots)
        return None if rows is None else self._batch_gates.setdefault(rows, BatchGate())

    def _judge_batch(self, owners: dict[int, Owner], result: StepOutput, num_drafts: dict[int, int]) -> None:
        """Folds a verification step over several requests into its row bucket's gate: its tokens
        against the rows a plain step would have given in its time."""
        if self._step_costs is None or len(owners) < 2:
            return
        slots = 1 + max(owners)
        cost = self._step_costs.ratio(slots, max(num_drafts.values(), default=0))
        if cost is None:  # a step the engine's warm-up did not measure
            return
        tokens = sum(int(result.num_tokens[slot]) for slot in owners if result.valid[slot])
        self._gate_of(slots).judge(self.speculation, tokens, len(owners) * cost)

    def _drafts(self, seq: SequenceState, heads: bool) -> tuple[list[int], SpeculativeMethod]:
        """The tokens `seq` drafts for this step (never past max_tokens or the context) and the drafter
        that proposed them: prompt lookup (NGRAM) or the heads, where `heads` (_heads_draft: their
        gate open) lets the heads' drafts go out."""
        config = self.speculation
        room = min(
            seq.sampling.max_tokens - len(seq.output_token_ids) - 1,
            self.max_seq_len - seq.num_computed - 1,
        )
        k = min(config.num_draft_tokens, seq.sampling.num_draft_tokens or config.num_draft_tokens, room)
        if k <= 0:
            return [], SpeculativeMethod.OFF
        if seq.lookup_gate.is_open and seq.num_unread_outputs == 1:
            # Prompt lookup first: where the text repeats its context its drafts are right more often
            # than the heads'. Only over the whole context: with an earlier step's token unread, this
            # step went out because lookup cannot match (_waits_for_tokens).
            looked_up = self._lookup(seq).propose(k)
            if looked_up:
                return looked_up, SpeculativeMethod.NGRAM
        # Else the heads' sure drafts, up to the first -1 (none unless they ran for the last step), while
        # their gate is open: a row verifying drafts must keep a drafter open, as the serving loop plans
        # that row's next step only after reading this one (its advance) while a drafter is open.
        drafted = list(itertools.takewhile(lambda t: t >= 0, seq.head_drafts[:k]))
        if heads and drafted:
            return drafted, SpeculativeMethod.HEADS
        return [], SpeculativeMethod.OFF

    def _reserve_draft_pages(self, seq: SequenceState, num_drafts: int) -> int:
        """Pages for positions up to num_computed + num_drafts, as far as free pages allow (drafts never
        preempt anyone); returns the drafts that have a page."""
        self._grow(seq, seq.num_computed + num_drafts)
        return min(num_drafts, len(seq.page_ids) * self.page_size - seq.num_computed - 1)

    def _after_verification(
        self, seq: SequenceState, num_drafts: int, num_tokens: int, drafter: SpeculativeMethod
    ) -> None:
        """Counts a verification row's drafts and accepted tokens, pauses the drafter that proposed them
        when its drafts keep failing, and gives back the pages that only rejected drafts used."""
        accepted = max(num_tokens - 1, 0)
        seq.num_drafted += num_drafts
        seq.num_accepted += accepted
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.num_verify_rows += 1
        gate = seq.heads_gate if drafter is SpeculativeMethod.HEADS else seq.lookup_gate
        gate.judge(self.speculation, num_drafts, accepted)
        keep = self._pages_for(seq.num_computed + 1)
        if len(seq.page_ids) > keep:
            self.pool.free(seq.page_ids[keep:][::-1])
            self._page_table[seq.slot, keep : len(seq.page_ids)] = NULL_PAGE
            del seq.page_ids[keep:]

    # ---- one step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plans the next step.

        1. Every running request gets a page for its next position, oldest first; when none is left
           the newest live request is preempted (possibly the one asking).
        2. Prompts being prefilled continue (in admission order) within the token budget.
        3. Waiting requests are admitted in order while a slot, the budget and the pages for their
           tokens last; one whose next uncached page another request is still prefilling waits for
           it (the requests behind it may go first).
        4. The decode batch lists every running request, including those whose prompt ended in 2-3
           and whose first decode position has a page.
        """
        self._step += 1
        preempted: list[str] = []
        running = [r for r in self._requests.values() if r.slot is not None]
        running.sort(key=lambda r: r.admission_order)
        for seq in [r for r in running if self._wants_decode(r)]:
            while seq.slot is not None and not self._grow(seq):
                victim = max((r for r in running if r.slot is not None), key=lambda r: r.admission_order)
                self._preempt(victim)
                preempted.append(victim.request_id)

        budget = self.prefill_token_budget
        chunks: list[PrefillChunk] = []
        prefill_owners: dict[int, Owner] = {}
        admitted: list[str] = []
        for seq in (r for r in running if r.status is RequestStatus.PREFILLING):
            if budget <= 0:
                break
            budget -= self._add_chunk(seq, budget, chunks, prefill_owners)
        upcoming: set[PageHash] = set()
        if self.pool.enable_prefix_caching:
            for seq in (r for r in running if r.status is RequestStatus.PREFILLING):
                upcoming.update(self._upcoming_keys(seq))
        deferred: list[SequenceState] = []
        while budget > 0 and self._waiting and self._free_slots and not preempted:
            seq = self._waiting[0]
            if upcoming and self._waits_for_prefix(seq, upcoming):
                deferred.append(self._waiting.popleft())
                continue
            if not self._admit(seq):
                break
            seq.admission_order = next(self._admissions)
            admitted.append(seq.request_id)
            budget -= self._add_chunk(seq, budget, chunks, prefill_owners)
            if self.pool.enable_prefix_caching and seq.status is RequestStatus.PREFILLING:
                upcoming.update(self._upcoming_keys(seq))
        self._waiting.extendleft(reversed(deferred))

        positions = np.full(self.num_slots, -1, np.int32)
        decode_owners: dict[int, Owner] = {}
        constrained: list[tuple[Matcher, int]] = []
        speculating = self._speculation_on()
        drafts: dict[int, list[int]] = {}
        drafted_by: dict[int, SpeculativeMethod] = {}
        heads_drafting = np.zeros(self.num_slots, bool)  # rows whose next drafts the heads propose
        for slot, seq in enumerate(self._slot_owner):
            if seq is None or not self._wants_decode(seq) or not self._grow(seq):
                continue
            positions[slot] = seq.num_computed
            decode_owners[slot] = (seq, seq.epoch)
            seq.num_dispatched_outputs += 1
            if seq.matcher is not None:
                constrained.append((seq.matcher, slot))
            heads = self._heads_draft(seq, speculating)
            if heads and seq.head_drafts and seq.head_drafts[0] < 0:
                # The heads ran for this row last step and were sure of nothing: a step's cost for no
                # drafts, judged as a step that accepted none (prompt lookup costs no device time).
                seq.heads_gate.judge(self.speculation, 0, 0)
                heads = seq.heads_gate.is_open
            proposed, drafter = [], SpeculativeMethod.OFF
            if speculating and self._drafts_allowed(seq):
                proposed, drafter = self._drafts(seq, heads)
            heads_drafting[slot] = heads
            seq.lookup_gate.tick()
            seq.heads_gate.tick()
            if proposed:
                proposed = proposed[: self._reserve_draft_pages(seq, len(proposed))]
            if proposed:  # its advance is known from the result: num_computed moves then
                drafts[slot] = proposed
                drafted_by[slot] = drafter
            else:
                seq.num_computed += 1
        batch = None
        if decode_owners:
            if (gate := self._batch_gate()) is not None:
                self.num_batch_plain_steps += not gate.is_open
                gate.tick()  # one decode step planned: a pause runs one step shorter
            masks = None
            if constrained:
                masks = allow_all(self.num_slots, self._grammar.num_words)
                self._grammar.fill_masks(constrained, masks)
            draft_array = None
            if drafts or heads_drafting.any():
                draft_array = np.full((self.num_slots, self.speculation.num_draft_tokens), -1, np.int32)
                for slot, proposed in drafts.items():
                    draft_array[slot, : len(proposed)] = proposed
            batch = DecodeBatch(positions, self._page_table.copy(), masks, draft_array, heads_drafting)
        self._check_invariants()
        return SchedulerOutput(
            step=self._step,
            prefill_chunks=tuple(chunks),
            decode_batch=batch,
            admitted_request_ids=tuple(admitted),
            preempted_request_ids=tuple(preempted),
            prefill_owners=prefill_owners,
            decode_owners=decode_owners,
            num_drafts={slot: len(d) for slot, d in drafts.items()},
            drafted_by=drafted_by,
        )

    def _add_chunk(
        self, seq: SequenceState, budget: int, chunks: list[PrefillChunk], owners: dict[int, Owner]
    ) -> int:
        assert seq.slot is not None
        start, fill = seq.num_computed, seq.fill_token_ids
        n = min(len(fill) - start, self.max_prefill_chunk, budget)
        is_last = start + n == len(fill)
        chunks.append(
            PrefillChunk(
                slot=seq.slot,
                token_ids=fill[start : start + n],
                start=start,
                sampling=seq.sampling,
                page_ids=tuple(seq.page_ids[: self._pages_for(start + n)]),
                is_last=is_last,
                prompt_token_ids=fill if is_last else (),
                num_generated=len(seq.output_token_ids),
                token_mask=self._grammar.allowed_mask(seq.matcher) if is_last and seq.matcher else None,
                drafting=is_last and self._heads_draft(seq, self._speculation_on()),
            )
        )
        seq.num_computed += n
        self._cache_full_pages(seq)
        if is_last:
            seq.status = RequestStatus.RUNNING
            seq.num_dispatched_outputs = len(seq.output_token_ids) + 1
            owners[seq.slot] = (seq, seq.epoch)
        return n

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        prefill_result: StepOutput | None,
        decode_result: StepOutput | None,
        *,
        defer_text: bool = False,
    ) -> list[RequestOutput]:
        """Credits one dispatched step's tokens (prefill's first tokens, then decode's) and finds stops.

        A token is dropped when its slot's owner at dispatch has finished or been preempted since: it
        was sampled after the request ended on the host, or will be sampled again on recompute.

        defer_text: leave the detokenising and stop-string matching of requests that go on to
        `flush_text()`, and return only the requests that end here. A serving loop that must read a step
        before planning the next (structured output: the next mask needs the last token) dispatches
        that next step in between, so the device does not wait for the text; a stop string then ends
        its request one step later, as it does whenever the loop reads a step after dispatching the next.
        """
        if self._deferred_text:
            raise RuntimeError("flush_text() must follow update_from_output(defer_text=True)")
        news: dict[str, _News] = {}
        finished: list[RequestOutput] = []
        # The rows the step's heads proposed for: a prefill chunk's `drafting`, a decode batch's.
        proposed_for = {c.slot: c.drafting for c in scheduler_output.prefill_chunks}
        batch = scheduler_output.decode_batch
        if batch is not None and batch.drafting is not None:
            proposed_for.update((slot, bool(batch.drafting[slot])) for slot in scheduler_output.decode_owners)
        for owners, result in [
            (scheduler_output.prefill_owners, prefill_result),
            (scheduler_output.decode_owners, decode_result),
        ]:
            if not owners:
                continue
            if result is None:
                raise ValueError(f"step {scheduler_output.step} dispatched work but got no result")
            for slot, (seq, epoch) in owners.items():
                if not (seq.is_live and seq.epoch == epoch and bool(result.valid[slot])):
                    continue
                # A step whose heads did not run for the row leaves no drafts: the last ones would be for
                # an old position (and () tells the next step the heads had no say).
                ran = result.drafts is not None and proposed_for.get(slot, True)
                seq.head_drafts = tuple(int(t) for t in result.drafts[slot]) if ran else ()
                count = int(result.num_tokens[slot])
                entry = news.setdefault(seq.request_id, _News(seq))
                reason = None
                for j in range(count):
                    ended = _device_reason(result, slot) if j == count - 1 else None
                    reason = self._credit(seq, entry, result, slot, j, defer_text, ended)
                    if reason is not None:
                        break
                if reason is not None and defer_text and seq.text is not None:
                    for token in entry.tokens:  # it ends here: its text cannot wait
                        reason = entry.add_text(token) or reason
                if owners is scheduler_output.decode_owners and slot in scheduler_output.num_drafts:
                    seq.num_computed += count  # the verified inputs: its last token and the accepted drafts
                    # Dispatch counted one output; steps dispatched since (a paused request does not
                    # wait for this result) have counted theirs on top.
                    seq.num_dispatched_outputs += count - 1
                    self._after_verification(
                        seq, scheduler_output.num_drafts[slot], count, scheduler_output.drafted_by[slot]
                    )
                if reason is not None:
                    finished.append(self._finish(seq, reason, **news.pop(seq.request_id).fields()))
                else:
                    self._cache_full_pages(seq)
        if batch is not None and batch.drafts is not None and decode_result is not None:
            self._judge_batch(scheduler_output.decode_owners, decode_result, scheduler_output.num_drafts)
        if defer_text:
            self._deferred_text = list(news.values())
            self._check_invariants()
            return finished
        running = [self._output(n.seq, **n.fields()) for n in news.values()]
        self._check_invariants()
        return finished + running

    def _credit(
        self,
        seq: SequenceState,
        entry: _News,
        result: StepOutput,
        slot: int,
        j: int,
        defer_text: bool,
        ended: FinishReason | None,
    ) -> FinishReason | None:
        """Appends the slot's j-th token of the step to `seq`; the reason it ends the request, if it does:
        a stop string, else `ended` (the device ended it there), the grammar's end, or the host-side
        backstops of what the device checks."""
        token = int(result.tokens[slot, j])
        seq.output_token_ids.append(token)
        entry.tokens.append(token)
        if seq.sampling.logprobs is not None:
            k = seq.sampling.logprobs
            top = zip(result.top_ids[slot, j][:k].tolist(), result.top_logprobs[slot, j][:k].tolist())
            entry.logprobs.append(TokenLogprobs(token, float(result.logprobs[slot, j]), tuple(top)))
        reason = None
        if seq.text is not None and not defer_text:
            reason = entry.add_text(token)
        reason = reason or ended
        if seq.matcher is not None and reason is None:
            if not seq.matcher.accept(token):  # the device applied its mask: a bug if reached
                raise RuntimeError(f"{seq.request_id}: token {token} broke its grammar")
            if seq.matcher.is_stopped:  # complete; only end-of-sequence could follow
                reason = FinishReason.STOP
        # Host-side backstops: the device should have flagged these as done.
        if reason is None and token in seq.sampling.stop_token_ids:
            reason = FinishReason.STOP
        if reason is None and len(seq.output_token_ids) >= seq.sampling.max_tokens:
            reason = FinishReason.LENGTH
        return reason

    def flush_text(self) -> list[RequestOutput]:
        """Detokenises the tokens update_from_output(defer_text=True) credited to requests that went on,
        matches their stop strings, and returns their outputs (a request cancelled in between has
        given its own)."""
        deferred, self._deferred_text = self._deferred_text, []
        finished, running = [], []
        for n in deferred:
            seq = n.seq
            if self._requests.get(seq.request_id) is not seq:
                continue
            reason = None
            for token in n.tokens:
                reason = n.add_text(token) or reason
            if reason is not None:
                finished.append(self._finish(seq, reason, **n.fields()))
            else:
                running.append(self._output(seq, **n.fields()))
        self._check_invariants()
        return finished + running

    def _check_invariants(self) -> None:
        """A slot is free exactly when no live request owns it; waiting requests own neither slots nor
        pages; the pool's holds are exactly the pages live requests list."""
        free = set(self._free_slots)
        if len(free) != len(self._free_slots):
            raise RuntimeError(f"scheduler invariant: duplicate free slots {self._free_slots}")
        for slot, owner in enumerate(self._slot_owner):
            if (owner is None) != (slot in free):
                raise RuntimeError(f"scheduler invariant: slot {slot} owner={owner} free={slot in free}")
            if owner is not None and (
                owner.slot != slot or self._requests.get(owner.request_id) is not owner
            ):
                raise RuntimeError(f"scheduler invariant: slot {slot} owned by a stale request")
        holding = sum(1 for r in self._requests.values() if r.slot is not None)
        if holding != self.num_slots - len(free) or holding + len(self._waiting) != len(self._requests):
            raise RuntimeError("scheduler invariant: live requests and slots disagree")
        if any(r.page_ids for r in self._waiting):
            raise RuntimeError("scheduler invariant: a waiting request holds pages")
        held = set().union(*(r.page_ids for r in self._requests.values()))
        if len(held) != self.pool.num_used or NULL_PAGE in held:
            raise RuntimeError(
                f"scheduler invariant: the pool holds {self.pool.num_used} pages, requests {held}"
            )


def _device_reason(result: StepOutput, slot: int) -> FinishReason | None:
    """Why the device ended the slot's request at its last token of the step, if it did."""
    if not bool(result.done[slot]):
        return None
    code = int(result.reason[slot])
    if code not in (FINISH_STOP, FINISH_LENGTH):
        raise ValueError(f"slot {slot} done with unknown reason code {code}")
    return FinishReason.STOP if code == FINISH_STOP else FinishReason.LENGTH


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A dispatched step whose results have not been read yet."""

    plan: SchedulerOutput
    prefill: PendingStep | None
    decode: PendingStep | None

    def results(self) -> tuple[StepOutput | None, StepOutput | None]:
        """Blocks until the step's results are on the host."""
        prefill = self.prefill.result() if self.prefill is not None else None
        return prefill, self.decode.result() if self.decode is not None else None


def dispatch(engine: Engine, plan: SchedulerOutput) -> InFlight | None:
    """Runs one plan on the engine without waiting for it: prefill chunks, then the decode batch."""
    if plan.is_empty:
        return None
    prefill = engine.prefill(plan.prefill_chunks) if plan.prefill_chunks else None
    decode = engine.decode(plan.decode_batch) if plan.decode_batch is not None else None
    return InFlight(plan, prefill, decode)
