"""Offline generation for a handful of prompts in one thread: the `jaxinfer generate` path.

Prompts go into free slots (long prompts in chunks), then every decode step advances all of them at
once; a finished prompt's slot takes the next waiting prompt. The next decode step is dispatched before
the previous one's tokens are read, so the device never idles on the host's detokenisation.
The threaded server (orchestrator.py) runs the same engine calls behind queues.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

from jaxinfer.engine import FINISH_LENGTH, FINISH_STOP, Engine, PrefillChunk, StepOutput
from jaxinfer.request import SamplingParams, check_request, with_eos
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" | "length"
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Live:
    index: int
    sampling: SamplingParams
    completion: Completion
    detok: object
    start: float
    prefill_start: float = 0.0
    first: float = 0.0
    last: float = 0.0


def generate(
    engine: Engine,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    sampling: Sequence[SamplingParams],
    *,
    on_text: Callable[[int, str], None] | None = None,
) -> list[Completion]:
    """Generates for every prompt (token ids); `on_text(prompt_index, new_text)` streams text as it forms."""
    if len(prompts) != len(sampling):
        raise ValueError(f"{len(prompts)=} but {len(sampling)=}")
    for ids, s in zip(prompts, sampling):
        check_request(ids, s, vocab_size=tokenizer.vocab_size, max_seq_len=engine.max_seq_len)
    waiting = collections.deque(range(len(prompts)))
    results = [Completion(prompt_token_ids=list(p)) for p in prompts]
    live: dict[int, _Live] = {}  # slot -> request
    start = time.perf_counter()

    def emit(req: _Live, text: str) -> None:
        if text and on_text is not None:
            on_text(req.index, text)

    def finish(slot: int, reason: str) -> None:
        req = live.pop(slot)
        c = req.completion
        tail = req.detok.flush()
        c.text += tail
        emit(req, tail)
        c.finish_reason = reason
        n = len(c.token_ids)
        c.ttft_s = req.first - req.start
        prefill_s = max(req.first - req.prefill_start, 1e-9)
        c.prefill_tokens_per_s = len(c.prompt_token_ids) / prefill_s
        if n > 1:
            c.tpot_s = (req.last - req.first) / (n - 1)
            c.decode_tokens_per_s = (n - 1) / max(req.last - req.first, 1e-9)

    def accept(out: StepOutput) -> None:
        now = time.perf_counter()
        for slot in list(live):
            if not out.valid[slot]:
                continue
            req = live[slot]
            c = req.completion
            token = int(out.token[slot])
            req.first = req.first or now
            req.last = now
            c.token_ids.append(token)
            device_stop = out.done[slot] and out.reason[slot] == FINISH_STOP
            piece = "" if device_stop else req.detok.add(token)  # the stop token's text is not output
            c.text += piece
            stop_at = _find_stop(c.text, req.sampling.stop, new_chars=len(piece))
            if stop_at is not None:
                emit(req, piece[: max(0, len(piece) - (len(c.text) - stop_at))])
                c.text = c.text[:stop_at]
                req.detok.flush()
                if not out.done[slot]:
                    engine.release(slot)
                finish(slot, "stop")
                continue
            emit(req, piece)
            if out.done[slot]:
                finish(slot, "length" if out.reason[slot] == FINISH_LENGTH else "stop")

    def admit() -> None:
        free = [s for s in range(engine.num_slots) if s not in live]
        chunk = engine.max_prefill_chunk
        while waiting and free:
            index, slot = waiting.popleft(), free.pop(0)
            ids = list(prompts[index])
            s = with_eos(sampling[index], tokenizer.eos_ids)
            req = _Live(index, s, results[index], tokenizer.detokenizer(), start, time.perf_counter())
            live[slot] = req
            pieces = range(0, len(ids), chunk)
            for begin in pieces:
                last = begin + chunk >= len(ids)
                step = engine.prefill(
                    [PrefillChunk(slot, ids[begin : begin + chunk], begin, s, last, ids if last else ())]
                )
            accept(step.result())

    admit()
    pending = engine.decode() if live else None
    while pending is not None:
        # Dispatch the next step before reading this one; a slot that finished here is inactive on the
        # device by then, and one released below produces nothing we keep (it left `live`).
        following = engine.decode() if live else None
        accept(pending.result())
        if waiting and len(live) < engine.num_slots:
            if following is not None:
                accept(following.result())
                following = None
            admit()
        pending = following if following is not None else (engine.decode() if live else None)
    return results


def _find_stop(text: str, stops: Sequence[str], new_chars: int) -> int | None:
    """Where the first stop string starts, looking only where the newest `new_chars` could complete one
    (the text before them was searched already)."""
    hits = [i for i in (text.find(s, max(0, len(text) - new_chars - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None
