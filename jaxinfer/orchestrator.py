"""The threads and queues that run an Engine and the Scheduler together (gRPC service, offline batches).

One request's life:
  1. `submit()` (any thread) validates the request, adds it to the scheduler's bounded waiting queue
     (QueueFull at once when full) and returns a RequestHandle.
  2. The device thread loops: `scheduler.schedule()`, then dispatch `engine.prefill` /
     `engine.decode` for the step (scheduler.dispatch). It does not wait for a step
     before dispatching the next one: after dispatching step n+1 it reads step n's results and calls
     `scheduler.update_from_output`, so host work overlaps device work. A slot that finished in step n
     may carry one speculative token in step n+1; the scheduler drops it (see scheduler.py). While a
     request with structured output runs, each step is read before the next is planned (its token mask
     needs its last token).
  3. `update_from_output` appends the tokens, runs each request's IncrementalDetokenizer (UTF-8 safe
     text) and its stop strings, and frees slots and pages at once. Its RequestOutputs go, with a
     timestamp, to the stream thread through a bounded queue.
  4. The stream thread turns them into StreamEvents on each request's own queue, and records the
     latency metrics. Iterating the RequestHandle reads that queue; the last event has the
     finish_reason (a request.FinishReason) and Usage.
  5. `handle.cancel()` finishes the request in the scheduler at once; its slot and pages are free
     for the next step, which no longer lists it.

The scheduler is pure Python and not thread-safe: every call to it holds `self._cond`'s lock, which
is never held while the device works. Engine calls happen on the device thread only.

Shutdown: `stop(grace_s)` stops admitting (submit raises NotAccepting), lets in-flight requests run
for up to grace_s, cancels the rest, drains the last step and joins the threads.

Failure: an unexpected exception in either thread is logged, every live request ends with "error",
admission stops and `on_fatal(exc)` is called (the server uses it to shut down): fail fast rather
than serve from a broken loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

from jaxinfer.engine import Engine
from jaxinfer.metrics import ServingMetrics
from jaxinfer.request import FinishReason, SamplingParams, check_request, with_eos
from jaxinfer.scheduler import QueueFull, RequestOutput, Scheduler, TokenLogprobs, dispatch
from jaxinfer.speculation.config import SpeculationConfig
from jaxinfer.structured_output import GrammarCompiler

log = logging.getLogger(__name__)

__all__ = ["NotAccepting", "Orchestrator", "QueueFull", "RequestHandle", "StreamEvent", "Usage"]


class NotAccepting(Exception):
    """The orchestrator is stopping, stopped or failed; no new requests (gRPC UNAVAILABLE)."""


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float | None  # None if no token was produced
    tpot_s: float | None  # None with fewer than two tokens
    queue_time_s: float | None  # None if the request never got a slot
    e2e_s: float


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when the request asked for them


class RequestHandle:
    """Iterate for StreamEvents (ends after the one with a finish_reason); `cancel()` from any thread."""

    def __init__(self, request_id: str, num_prompt_tokens: int, orchestrator: Orchestrator):
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self._orchestrator = orchestrator
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()  # bounded by max_tokens
        self._done = False
        # Timestamps (time.monotonic); admitted_at is written by the device thread, the rest by the
        # stream thread.
        self.submitted_at = time.monotonic()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._wakeup: Callable[[], None] | None = None  # set by __aiter__

    def cancel(self) -> None:
        """Ends the request with finish_reason CANCELLED (a no-op once it has finished)."""
        self._orchestrator._cancel(self)

    def _put(self, event: StreamEvent) -> None:
        self._events.put(event)
        if self._wakeup is not None:
            self._wakeup()

    def __iter__(self) -> Iterator[StreamEvent]:
        while not self._done:
            event = self._events.get()
            if event.finish_reason is not None:
                self._done = True
            yield event

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        """The same events for an asyncio task (the HTTP server), without a thread per stream."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        self._wakeup = lambda: loop.call_soon_threadsafe(ready.set)
        while not self._done:
            ready.clear()
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                await ready.wait()
                continue
            if event.finish_reason is not None:
                self._done = True
            yield event

    def collect(self) -> tuple[list[int], str, StreamEvent]:
        """Reads the whole stream: (token ids, text, last event)."""
        tokens: list[int] = []
        texts: list[str] = []
        last = None
        for last in self:
            tokens.extend(last.token_ids)
            texts.append(last.text)
        assert last is not None
        return tokens, "".join(texts), last


_STOP = object()  # stream-queue sentinel


class Orchestrator:
    """Runs `engine` with a Scheduler on two threads (see the module docstring).

    max_queue: most requests waiting for a slot; submit raises QueueFull beyond it.
    prefill_token_budget: most prompt tokens per step (default: engine.max_prefill_chunk).
    enable_prefix_caching: reuse the KV pages of earlier requests' common prefixes.
    metrics: where latencies and gauges go (default: a new ServingMetrics).
    structured_output: accept requests with a grammar; None: when the tokenizer can list its tokens
        (building the token table takes ~1 s for a 262k vocabulary).
    speculation: draft tokens for the engine to verify (scheduler.py; the engine must verify as many).
    on_fatal: called once, from the failing thread, after an unexpected exception; it must not block
        (to stop a server from it, start a thread that calls stop()).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        *,
        max_queue: int = 64,
        prefill_token_budget: int | None = None,
        enable_prefix_caching: bool = True,
        metrics: ServingMetrics | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        structured_output: bool | None = None,
        speculation: SpeculationConfig | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        if structured_output is None:
            structured_output = GrammarCompiler.supports(tokenizer)
        self._grammar = GrammarCompiler(tokenizer) if structured_output else None
        self.metrics = metrics if metrics is not None else ServingMetrics()
        self.on_fatal = on_fatal
        self._scheduler = Scheduler(
            num_slots=engine.num_slots,
            max_seq_len=engine.max_seq_len,
            max_prefill_chunk=engine.max_prefill_chunk,
            page_size=engine.page_size,
            num_pages=engine.num_pages,
            max_queue=max_queue,
            prefill_token_budget=prefill_token_budget,
            enable_prefix_caching=enable_prefix_caching,
            detokenizer_factory=tokenizer.detokenizer,
            grammar_compiler=self._grammar,
            speculation=speculation,
            draft_heads_depth=engine.draft_heads_depth,
            step_costs=engine.step_costs,
        )
        self._cond = threading.Condition()  # guards _scheduler and the flags below
        # Live handles: added by submit(), removed by the stream thread when the last event is sent.
        self._handles: dict[str, RequestHandle] = {}
        self._accepting = False
        self._stopping = False
        self._failure: BaseException | None = None
        self._stream_failed = False
        self._ids = itertools.count()
        self._num_steps = 0
        self._finished_by_reason = dict.fromkeys(FinishReason, 0)
        # Each item is one step's outputs. The stream thread only formats and enqueues, so it keeps
        # up; if it ever falls this far behind the device thread waits (back-pressure, bounded memory).
        self._stream_queue: queue.Queue = queue.Queue(maxsize=256)
        self._device_thread = threading.Thread(
            target=self._run_device_loop, name="jaxinfer-device", daemon=True
        )
        self._stream_thread = threading.Thread(
            target=self._run_stream_loop, name="jaxinfer-stream", daemon=True
        )

    # ---- public API ----------------------------------------------------------------------------------

    def start(self) -> Orchestrator:
        with self._cond:
            if self._device_thread.is_alive() or self._stopping:
                raise RuntimeError("Orchestrator.start() called twice")
            self._accepting = True
        self._device_thread.start()
        self._stream_thread.start()
        return self

    def submit(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams, request_id: str | None = None
    ) -> RequestHandle:
        """Queues one request. Raises ValueError (bad request), QueueFull, or NotAccepting."""
        prompt = [int(t) for t in prompt_token_ids]
        vocab, context = self.tokenizer.vocab_size, self.engine.max_seq_len
        check_request(prompt, sampling, vocab_size=vocab, max_seq_len=context)
        sampling = with_eos(sampling, self.tokenizer.eos_ids)
        matcher = None
        if sampling.structured_output is not None and self._grammar is not None:
            matcher = self._grammar.matcher(sampling.structured_output)  # compiles: not under the lock
        if not request_id:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        with self._cond:
            if not self._accepting:
                raise NotAccepting("the server is not accepting requests (stopping or failed)")
            if request_id in self._handles:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._scheduler.add_request(request_id, prompt, sampling, matcher)  # QueueFull / ValueError
            handle = RequestHandle(request_id, len(prompt), self)
            self._handles[request_id] = handle
            self._cond.notify_all()
        return handle

    def stop(self, grace_s: float = 5.0) -> None:
        """Stops admitting, lets in-flight requests finish for up to grace_s, cancels the rest, joins."""
        if threading.current_thread() in (self._device_thread, self._stream_thread):
            raise RuntimeError("Orchestrator.stop() must not be called from its own threads (see on_fatal)")
        deadline = time.monotonic() + max(grace_s, 0.0)
        with self._cond:
            self._accepting = False
            while self._scheduler.num_live and self._device_thread.is_alive():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            outputs = self._scheduler.finish_all(FinishReason.CANCELLED)
            if outputs:
                self._push_outputs(outputs, num_prefill=0)
            self._stopping = True
            self._cond.notify_all()
        if self._device_thread.is_alive():
            self._device_thread.join()
        if self._stream_thread.is_alive():
            self._stream_queue.put(_STOP)
            self._stream_thread.join()

    def stats(self) -> dict:
        """Counts and gauges now, plus the metrics snapshot (latency percentiles, token rates)."""
        with self._cond:
            s = self._scheduler
            stats = {
                "num_slots": s.num_slots,
                "num_free_slots": s.num_free_slots,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "num_live": s.num_live,
                "tokens_held": s.num_tokens_held(),
                "kv_pages_used": s.pool.num_used,
                "kv_pages_total": s.pool.num_usable,
                "kv_cache_utilization": s.kv_cache_utilization(),
                "num_preemptions": s.num_preemptions,
                "prefix_cache_query_tokens": s.prefix_query_tokens,
                "prefix_cache_hit_tokens": s.prefix_hit_tokens,
                "spec_draft_tokens": s.num_draft_tokens,
                "spec_accepted_tokens": s.num_accepted_tokens,
                "num_steps": self._num_steps,
                "finished": {str(r): n for r, n in self._finished_by_reason.items()},
                "accepting": self._accepting,
                "failed": self._failure is not None,
            }
        stats["metrics"] = self.metrics.snapshot()
        return stats

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def started(self) -> bool:
        return self._device_thread.ident is not None

    @property
    def max_queue(self) -> int:
        return self._scheduler.max_queue

    @property
    def enable_prefix_caching(self) -> bool:
        return self._scheduler.pool.enable_prefix_caching

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # ---- internals -----------------------------------------------------------------------------------

    def _cancel(self, handle: RequestHandle) -> None:
        with self._cond:
            if self._handles.get(handle.request_id) is not handle:  # finished (the id may be reused since)
                return
            output = self._scheduler.finish_request(handle.request_id, FinishReason.CANCELLED)
            self._cond.notify_all()
            if output is not None:
                self._push_outputs([output], num_prefill=0)

    def _push_outputs(self, outputs: list[RequestOutput], *, num_prefill: int) -> None:
        """Hands one batch to the stream thread. Callers hold self._cond, so batches stay in step order."""
        item = (time.monotonic(), outputs, num_prefill)
        while not self._stream_failed:
            try:
                self._stream_queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _fail(self, exc: BaseException, where: str) -> None:
        log.critical("jaxinfer %s thread failed; stopping", where, exc_info=exc)
        if where == "stream":
            self._stream_failed = True  # unblocks a device thread waiting to put into the stream queue
        with self._cond:
            first = self._failure is None
            self._failure = self._failure or exc
            self._accepting = False
            self._stopping = True
            outputs = self._scheduler.finish_all(FinishReason.ERROR)
            if where == "device" and outputs:
                self._push_outputs(outputs, num_prefill=0)
            self._cond.notify_all()
        if where == "stream":  # nobody reads the stream queue any more: end every open stream directly
            for handle in list(self._handles.values()):
                self._handles.pop(handle.request_id, None)
                handle._put(StreamEvent("", (), FinishReason.ERROR))
        if first and self.on_fatal is not None:
            try:
                self.on_fatal(exc)
            except Exception:  # noqa: BLE001 - the callback must not hide the original failure
                log.exception("on_fatal callback failed")

    def _run_device_loop(self) -> None:
        try:
            self._device_loop()
        except BaseException as exc:  # noqa: BLE001 - fail fast: log, end every request, stop
            self._fail(exc, "device")

    def _device_loop(self) -> None:
        engine, scheduler = self.engine, self._scheduler
        in_flight = None  # the dispatched step whose results are read next (scheduler.InFlight)
        while True:
            with self._cond:
                while in_flight is None and not scheduler.has_work() and not self._stopping:
                    self._cond.wait()
                if self._stopping and in_flight is None and not scheduler.has_work():
                    return
                # Structured output needs step n's tokens to plan step n + 1: read it first, and leave
                # its text until n + 1 is dispatched.
                read_first = in_flight is not None and scheduler.needs_results_first()
            if read_first:
                self._read(in_flight, defer_text=True)
                in_flight = None
            with self._cond:
                plan = scheduler.schedule()
                self._num_steps += 1
                self._update_gauges()
                now = time.monotonic()
                for request_id in plan.admitted_request_ids:
                    handle = self._handles.get(request_id)
                    if handle is not None and handle.admitted_at is None:
                        handle.admitted_at = now
            # Dispatch step n+1 ...
            following = dispatch(engine, plan)
            # ... then read step n (or the text of step n, read first) while the device runs n+1.
            if read_first:
                with self._cond:
                    self._push_outputs(scheduler.flush_text(), num_prefill=0)
                    self._update_gauges()
                    self._cond.notify_all()
            if in_flight is not None:
                self._read(in_flight)
            in_flight = following

    def _read(self, in_flight, *, defer_text: bool = False) -> None:
        """Waits for a dispatched step and hands its outputs to the stream thread."""
        prefill_out, decode_out = in_flight.results()
        with self._cond:
            outputs = self._scheduler.update_from_output(
                in_flight.plan, prefill_out, decode_out, defer_text=defer_text
            )
            self._update_gauges()
            self._push_outputs(outputs, num_prefill=in_flight.plan.num_prefill_tokens)
            self._cond.notify_all()  # stop() waits for the live count to drop

    def _update_gauges(self) -> None:
        s = self._scheduler
        self.metrics.set_state(
            queue_depth=s.num_waiting,
            running=s.num_running,
            slot_occupancy=s.num_running / s.num_slots,
            kv_cache_utilization=s.kv_cache_utilization(),
            kv_pages_used=s.pool.num_used,
            kv_pages_total=s.pool.num_usable,
            num_preemptions=s.num_preemptions,
            prefix_cache_query_tokens=s.prefix_query_tokens,
            prefix_cache_hit_tokens=s.prefix_hit_tokens,
            spec_draft_tokens=s.num_draft_tokens,
            spec_accepted_tokens=s.num_accepted_tokens,
            spec_verify_steps=s.num_verify_rows,
            spec_batch_plain_steps=s.num_batch_plain_steps,
        )

    def _run_stream_loop(self) -> None:
        try:
            while True:
                item = self._stream_queue.get()
                if item is _STOP:
                    return
                self._stream_step(*item)
        except BaseException as exc:  # noqa: BLE001 - fail fast
            self._fail(exc, "stream")

    def _stream_step(self, now: float, outputs: list[RequestOutput], num_prefill: int) -> None:
        num_decode = 0
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:  # already ended (e.g. by a stream-thread failure)
                continue
            n = len(out.new_token_ids)
            if n:
                if handle.first_token_at is None:
                    handle.first_token_at = now
                    num_decode += n - 1  # the first token comes from prefill
                else:
                    num_decode += n
                    self.metrics.observe_inter_token([(now - handle.last_token_at) / n] * n)
                handle.last_token_at = now
                handle.num_output_tokens += n
            usage = None
            if out.finish_reason is not None:
                usage = self._finish_handle(handle, out.finish_reason, now)
            handle._put(
                StreamEvent(out.new_text, out.new_token_ids, out.finish_reason, usage, out.new_logprobs)
            )
        self.metrics.observe_step(num_prefill_tokens=num_prefill, num_decode_tokens=num_decode)

    def _finish_handle(self, handle: RequestHandle, reason: FinishReason, now: float) -> Usage:
        handle.finish_reason = reason
        t0 = handle.submitted_at
        ttft = None if handle.first_token_at is None else handle.first_token_at - t0
        tpot = None
        if handle.num_output_tokens > 1:
            tpot = (handle.last_token_at - handle.first_token_at) / (handle.num_output_tokens - 1)
        queue_time = None if handle.admitted_at is None else handle.admitted_at - t0
        usage = Usage(handle.num_prompt_tokens, handle.num_output_tokens, ttft, tpot, queue_time, now - t0)
        self.metrics.observe_request(
            queue_time_s=queue_time, ttft_s=ttft, tpot_s=tpot, e2e_s=usage.e2e_s, finish_reason=reason
        )
        # Plain dict operations (atomic under the GIL): the stream thread never takes self._cond, so the
        # device thread may block on a full stream queue while holding it.
        self._handles.pop(handle.request_id, None)
        self._finished_by_reason[reason] += 1
        return usage
