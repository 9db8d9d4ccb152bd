"""Offline generation for a handful of prompts in one thread: the `jaxinfer generate` path.

The same Scheduler as the server decides admission, chunking, pages, preemption and stops; this loop
only runs it: schedule step n+1, dispatch it, then read step n's results while the device works, so
the device never idles on the host's detokenisation (a request with structured output needs each step
read before the next is planned). The threaded server (orchestrator.py) runs the same three calls
behind queues.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from jaxinfer.engine import Engine
from jaxinfer.request import FinishReason, SamplingParams, check_request, with_eos
from jaxinfer.scheduler import InFlight, RequestOutput, Scheduler, TokenLogprobs, dispatch
from jaxinfer.speculation.config import SpeculationConfig
from jaxinfer.structured_output import GrammarCompiler
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted, and accepted
    num_accepted_tokens: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # when asked for

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Timing:
    admitted: float = 0.0
    first: float = 0.0
    last: float = 0.0


def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams],
    *,
    on_text: Callable[[int, str], None] | None = None,
    enable_prefix_caching: bool = True,
    speculation: SpeculationConfig | None = None,
) -> list[Completion]:
    """Generates for every prompt (token ids); `on_text(prompt_index, new_text)` streams text as it forms.
    speculation: draft and verify tokens (the engine must verify as many drafts per step)."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)=} but {len(sampling)=}")
    for ids, s in zip(prompts, sampling):
        check_request(ids, s, vocab_size=tokenizer.vocab_size, max_seq_len=engine.max_seq_len)
    scheduler = Scheduler(
        num_slots=engine.num_slots,
        max_seq_len=engine.max_seq_len,
        max_prefill_chunk=engine.max_prefill_chunk,
        page_size=engine.page_size,
        num_pages=engine.num_pages,
        max_queue=max(1, len(prompts)),
        enable_prefix_caching=enable_prefix_caching,
        detokenizer_factory=tokenizer.detokenizer,
        grammar_compiler=GrammarCompiler(tokenizer) if any(s.structured_output for s in sampling) else None,
        speculation=speculation,
        draft_heads_depth=engine.draft_heads_depth,
        step_costs=engine.step_costs,
    )
    for index, (ids, s) in enumerate(zip(prompts, sampling)):
        scheduler.add_request(str(index), ids, with_eos(s, tokenizer.eos_ids))
    results = [Completion(prompt_token_ids=list(p)) for p in prompts]
    timings = [_Timing() for _ in prompts]
    start = time.perf_counter()

    def read(step: InFlight, *, defer_text: bool = False) -> None:
        take(scheduler.update_from_output(step.plan, *step.results(), defer_text=defer_text))

    def take(outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for out in outputs:
            index = int(out.request_id)
            c, timing = results[index], timings[index]
            if out.new_token_ids:
                timing.first = timing.first or now
                timing.last = now
            c.token_ids.extend(out.new_token_ids)
            c.text += out.new_text
            c.logprobs.extend(out.new_logprobs)
            c.num_cached_tokens = out.num_cached_tokens
            c.num_draft_tokens, c.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
            if out.new_text and on_text is not None:
                on_text(index, out.new_text)
            if out.finish_reason is not None:
                c.finish_reason = out.finish_reason
                _record_timings(c, timing, start)

    in_flight = None
    while scheduler.has_work() or in_flight is not None:
        # Structured output needs step n's tokens to plan step n + 1: read it first, and leave its text
        # until n + 1 is dispatched.
        text_waits = in_flight is not None and scheduler.needs_results_first()
        if text_waits:
            read(in_flight, defer_text=True)
            in_flight = None
        plan = scheduler.schedule()
        now = time.perf_counter()
        for request_id in plan.admitted_request_ids:
            timing = timings[int(request_id)]
            timing.admitted = timing.admitted or now
        following = dispatch(engine, plan)
        if text_waits:
            take(scheduler.flush_text())
        if in_flight is not None:
            read(in_flight)
        in_flight = following
    return results


def _record_timings(c: Completion, timing: _Timing, start: float) -> None:
    n = len(c.token_ids)
    c.ttft_s = timing.first - start
    c.prefill_tokens_per_s = len(c.prompt_token_ids) / max(timing.first - timing.admitted, 1e-9)
    if n > 1:
        c.tpot_s = (timing.last - timing.first) / (n - 1)
        c.decode_tokens_per_s = (n - 1) / max(timing.last - timing.first, 1e-9)
