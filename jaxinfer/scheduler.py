"""Continuous-batching policy: which request gets a slot, which prompt chunks run, when a request ends.

Pure Python: no JAX, no threads, no clock. The orchestrator calls it under one lock. One engine step is

    out = scheduler.schedule()                     # decide: releases, prefill chunks, decode or not
    ... engine.release / prefill / decode ...      # dispatch (the results may arrive a step later)
    scheduler.update_from_output(out, prefill_result, decode_result)   # credit tokens, find stops

A request moves WAITING -> PREFILLING -> RUNNING -> FINISHED. Slots are taken at the first prefill
chunk and given back the moment the request finishes on the host (stop token or string, length,
cancel); a host-side finish also queues `engine.release(slot)` for the very next step.

Pipelining: the orchestrator reads step n's results only after dispatching step n+1, so step n+1 may
carry a token for a request that finished in step n (or whose slot has since been handed to another
request). Each SchedulerOutput therefore snapshots which request owned each slot when it was
dispatched; a token is credited only to that request and only while it is still live, else dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Protocol

from jaxinfer.engine import FINISH_LENGTH, FINISH_STOP, PrefillChunk, StepOutput
from jaxinfer.request import SamplingParams


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


FINISH_REASONS = ("stop", "length", "cancelled", "error")


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
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_prefilled: int = 0  # prompt tokens dispatched to the engine
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def is_live(self) -> bool:
        return self.status is not RequestStatus.FINISHED

    @property
    def num_tokens_held(self) -> int:
        """KV entries this request occupies in its slot."""
        return self.num_prefilled + len(self.output_token_ids)


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (only requests with news appear)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: str | None  # None while running, else one of FINISH_REASONS
    num_prompt_tokens: int
    num_output_tokens: int  # total so far


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. The orchestrator applies it in field order: release, prefill, decode."""

    step: int
    released_slots: tuple[int, ...]  # engine.release(slot) before anything else
    prefill_chunks: tuple[PrefillChunk, ...]
    decode: bool
    admitted_request_ids: tuple[str, ...]  # got a slot this step (for queue-time metrics)
    # Owner of each slot at dispatch: the only request that may be credited with that slot's token.
    prefill_owners: dict[int, SequenceState]  # slots whose last chunk runs this step
    decode_owners: dict[int, SequenceState]  # slots that are RUNNING, including this step's last chunks

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefill_chunks)

    @property
    def is_empty(self) -> bool:
        return not (self.released_slots or self.prefill_chunks or self.decode)


class Scheduler:
    """FIFO admission into a fixed set of slots with chunked prefill under a per-step token budget.

    num_slots, max_seq_len, max_prefill_chunk: the engine's (see engine.Engine).
    max_queue: most WAITING requests; add_request raises QueueFull beyond it.
    prefill_token_budget: most prompt tokens per step over all chunks (default max_prefill_chunk), so a
        long prompt is spread over several steps while running requests keep decoding every step.
    detokenizer_factory: makes one IncrementalDetokenizer per request (for text and stop strings);
        None only if no request uses stop strings (outputs then carry no text).
    """

    def __init__(
        self,
        *,
        num_slots: int,
        max_seq_len: int,
        max_prefill_chunk: int,
        max_queue: int,
        prefill_token_budget: int | None = None,
        detokenizer_factory: Callable[[], IncrementalDetokenizer] | None = None,
    ):
        budget = max_prefill_chunk if prefill_token_budget is None else prefill_token_budget
        for name, value in [
            ("num_slots", num_slots),
            ("max_seq_len", max_seq_len),
            ("max_prefill_chunk", max_prefill_chunk),
            ("max_queue", max_queue),
            ("prefill_token_budget", budget),
        ]:
            if value <= 0:
                raise ValueError(f"{name}={value} must be > 0")
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.max_prefill_chunk = max_prefill_chunk
        self.max_queue = max_queue
        self.prefill_token_budget = budget
        self._detokenizer_factory = detokenizer_factory
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._requests: dict[str, SequenceState] = {}  # every live request
        self._slot_owner: list[SequenceState | None] = [None] * num_slots
        self._free_slots: list[int] = list(range(num_slots))  # kept sorted: lowest slot first
        self._pending_release: list[int] = []
        self._step = 0

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

    def num_tokens_held(self) -> int:
        return sum(r.num_tokens_held for r in self._slot_owner if r is not None)

    def has_work(self) -> bool:
        return bool(self._requests or self._pending_release)

    def get(self, request_id: str) -> SequenceState | None:
        return self._requests.get(request_id)

    # ---- admission and finishing --------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Queues a request. Raises ValueError for a bad request, QueueFull when the queue is full."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        sampling.validate()
        if len(prompt_token_ids) + sampling.max_tokens > self.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt_token_ids)} tokens + max_tokens={sampling.max_tokens} exceeds the "
                f"context length max_seq_len={self.max_seq_len}"
            )
        if sampling.stop and self._detokenizer_factory is None:
            raise ValueError("stop strings need a detokenizer_factory")
        if len(self._waiting) >= self.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
        text = None
        if self._detokenizer_factory is not None:
            text = _StopStringText(self._detokenizer_factory(), sampling.stop)
        seq = SequenceState(request_id, tuple(int(t) for t in prompt_token_ids), sampling, text)
        self._requests[request_id] = seq
        self._waiting.append(seq)

    def finish_request(self, request_id: str, reason: str) -> RequestOutput | None:
        """Ends a live request now (cancel, deadline, error); its slot is free for the next step.

        Returns the request's final output, or None if it is not live (already finished: a no-op).
        """
        if reason not in FINISH_REASONS:
            raise ValueError(f"{reason=} not in {FINISH_REASONS}")
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        if seq.status is RequestStatus.WAITING:
            self._waiting.remove(seq)
        return self._finish(seq, reason, new_tokens=(), new_text="", release=True)

    def finish_all(self, reason: str) -> list[RequestOutput]:
        outputs = [self.finish_request(rid, reason) for rid in list(self._requests)]
        return [o for o in outputs if o is not None]

    def _finish(
        self, seq: SequenceState, reason: str, *, new_tokens: tuple[int, ...], new_text: str, release: bool
    ) -> RequestOutput:
        if seq.text is not None:
            new_text += seq.text.finish()
        seq.status, seq.finish_reason = RequestStatus.FINISHED, reason
        del self._requests[seq.request_id]
        if seq.slot is not None:
            self._slot_owner[seq.slot] = None
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
            if release:  # the device may still consider the slot active
                self._pending_release.append(seq.slot)
        return self._output(seq, new_tokens, new_text)

    @staticmethod
    def _output(seq: SequenceState, new_tokens: tuple[int, ...], new_text: str) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_tokens,
            new_text=new_text,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
        )

    # ---- one step -----------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plans the next step: pending releases, then prefill chunks within the budget, then decode.

        Prompts already being prefilled continue first (in admission order), then waiting requests
        take free slots, lowest first. Each request gets at most one chunk per step.
        """
        self._step += 1
        released = tuple(self._pending_release)
        self._pending_release.clear()
        budget = self.prefill_token_budget
        chunks: list[PrefillChunk] = []
        prefill_owners: dict[int, SequenceState] = {}
        admitted: list[str] = []

        # _requests keeps arrival order, which is also admission order (FIFO).
        prefilling = [r for r in self._requests.values() if r.status is RequestStatus.PREFILLING]
        for seq in prefilling:
            if budget <= 0:
                break
            budget -= self._add_chunk(seq, budget, chunks, prefill_owners)
        while budget > 0 and self._waiting and self._free_slots:
            seq = self._waiting.popleft()
            seq.slot = self._free_slots.pop(0)
            seq.status = RequestStatus.PREFILLING
            self._slot_owner[seq.slot] = seq
            admitted.append(seq.request_id)
            budget -= self._add_chunk(seq, budget, chunks, prefill_owners)

        decode_owners = {
            slot: r
            for slot, r in enumerate(self._slot_owner)
            if r is not None and r.status is RequestStatus.RUNNING
        }
        self._check_invariants()
        return SchedulerOutput(
            step=self._step,
            released_slots=released,
            prefill_chunks=tuple(chunks),
            decode=bool(decode_owners),
            admitted_request_ids=tuple(admitted),
            prefill_owners=prefill_owners,
            decode_owners=decode_owners,
        )

    def _add_chunk(
        self, seq: SequenceState, budget: int, chunks: list[PrefillChunk], owners: dict[int, SequenceState]
    ) -> int:
        assert seq.slot is not None
        start = seq.num_prefilled
        n = min(len(seq.prompt_token_ids) - start, self.max_prefill_chunk, budget)
        is_last = start + n == len(seq.prompt_token_ids)
        chunks.append(
            PrefillChunk(
                slot=seq.slot,
                token_ids=seq.prompt_token_ids[start : start + n],
                start=start,
                sampling=seq.sampling,
                is_last=is_last,
                prompt_token_ids=seq.prompt_token_ids if is_last else (),
            )
        )
        seq.num_prefilled += n
        if is_last:
            seq.status = RequestStatus.RUNNING
            owners[seq.slot] = seq
        return n

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        prefill_result: StepOutput | None,
        decode_result: StepOutput | None,
    ) -> list[RequestOutput]:
        """Credits one dispatched step's tokens (prefill's first tokens, then decode's) and finds stops.

        A token is dropped when its slot's owner at dispatch is no longer live: it was sampled
        speculatively after the request finished on the host in an earlier step.
        """
        news: dict[str, tuple[SequenceState, list[int], list[str]]] = {}
        finished: list[RequestOutput] = []
        for owners, result in [
            (scheduler_output.prefill_owners, prefill_result),
            (scheduler_output.decode_owners, decode_result),
        ]:
            if not owners:
                continue
            if result is None:
                raise ValueError(f"step {scheduler_output.step} dispatched work but got no result")
            for slot, seq in owners.items():
                if not (seq.is_live and bool(result.valid[slot])):
                    continue
                token = int(result.token[slot])
                seq.output_token_ids.append(token)
                entry = news.setdefault(seq.request_id, (seq, [], []))
                entry[1].append(token)
                reason = None
                if seq.text is not None:
                    new_text, stop_string_hit = seq.text.add(token)
                    entry[2].append(new_text)
                    reason = "stop" if stop_string_hit else None
                if bool(result.done[slot]):
                    # The device deactivated the slot itself; no release needed.
                    device_reason = int(result.reason[slot])
                    if device_reason not in (FINISH_STOP, FINISH_LENGTH):
                        raise ValueError(f"slot {slot} done with unknown reason code {device_reason}")
                    reason = reason or ("stop" if device_reason == FINISH_STOP else "length")
                    finished.append(self._finish_with_news(seq, reason, news, release=False))
                    continue
                # Host-side backstops: the device should have flagged these as done.
                if reason is None and token in seq.sampling.stop_token_ids:
                    reason = "stop"
                if reason is None and len(seq.output_token_ids) >= seq.sampling.max_tokens:
                    reason = "length"
                if reason is not None:
                    finished.append(self._finish_with_news(seq, reason, news, release=True))
        running = [self._output(seq, tuple(toks), "".join(texts)) for seq, toks, texts in news.values()]
        self._check_invariants()
        return finished + running

    def _finish_with_news(
        self,
        seq: SequenceState,
        reason: str,
        news: dict[str, tuple[SequenceState, list[int], list[str]]],
        *,
        release: bool,
    ) -> RequestOutput:
        _, tokens, texts = news.pop(seq.request_id)
        return self._finish(seq, reason, new_tokens=tuple(tokens), new_text="".join(texts), release=release)

    def _check_invariants(self) -> None:
        """A slot is free exactly when no live request owns it; waiting requests own none."""
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
        if len(self._waiting) > self.max_queue:
            raise RuntimeError("scheduler invariant: waiting queue over max_queue")
