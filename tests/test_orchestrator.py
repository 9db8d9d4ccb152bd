"""Orchestrator threads: exact streams under concurrency, pipelining, validation, queue limit, cancel,
graceful stop and fail-fast, against MockEngine + FakeTokenizer."""

import dataclasses
import random
import threading
import time

import pytest

from jaxinfer.orchestrator import NotAccepting, Orchestrator, QueueFull
from jaxinfer.request import SamplingParams
from jaxinfer.testing import FakeTokenizer, MockEngine, wait_until

TOK = FakeTokenizer()


def make(*, num_slots=4, max_seq_len=64, max_prefill_chunk=8, step_delay_s=0.0, max_queue=64, **kw):
    engine = MockEngine(
        num_slots=num_slots,
        max_seq_len=max_seq_len,
        max_prefill_chunk=max_prefill_chunk,
        vocab_size=TOK.vocab_size,
        step_delay_s=step_delay_s,
        **kw,
    )
    return engine, Orchestrator(engine, TOK, max_queue=max_queue, prefill_token_budget=12)


def expected(engine, prompt, sampling):
    """MockEngine's reference with the EOS ids the orchestrator adds (unless ignore_eos)."""
    stop_ids = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else TOK.eos_ids)
    return engine.reference_tokens(prompt, dataclasses.replace(sampling, stop_token_ids=stop_ids))


def test_concurrent_mixed_requests_stream_exact_tokens_and_text():
    engine, orch = make(num_slots=4, step_delay_s=0.001)
    orch.start()
    rng = random.Random(0)
    jobs = []
    for _ in range(24):
        prompt = [rng.randrange(4, TOK.vocab_size) for _ in range(rng.randint(1, 30))]
        sampling = SamplingParams(
            seed=rng.randrange(4),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=rng.choice([1.0, 0.9]),
            max_tokens=rng.randint(1, 64 - len(prompt)),
            ignore_eos=rng.random() < 0.3,
        )
        jobs.append((prompt, sampling))
    results = [None] * len(jobs)

    def client(i):
        prompt, sampling = jobs[i]
        handle = orch.submit(prompt, sampling)
        results[i] = handle.collect()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for (prompt, sampling), (tokens, text, last) in zip(jobs, results, strict=True):
        want = expected(engine, prompt, sampling)
        assert tokens == want
        assert text == TOK.decode(want)
        reason = "stop" if (want[-1] in TOK.eos_ids and not sampling.ignore_eos) else "length"
        assert last.finish_reason == reason
        u = last.usage
        assert (u.prompt_tokens, u.completion_tokens) == (len(prompt), len(want))
        assert 0 <= u.queue_time_s <= u.ttft_s <= u.e2e_s
        assert (u.tpot_s is None) == (len(want) == 1)
    stats = orch.stats()
    assert stats["num_free_slots"] == 4 and stats["num_live"] == 0 and stats["tokens_held"] == 0
    assert stats["kv_pages_used"] == 0
    assert sum(stats["finished"].values()) == len(jobs)
    assert stats["metrics"]["latency"]["ttft"]["count"] == len(jobs)
    # The device loop dispatched decode n+1 before reading decode n.
    assert engine.max_unread_decodes >= 2
    orch.stop(1.0)


def test_stop_strings_and_multibyte_text_through_the_threads():
    engine, orch = make(num_slots=2)
    orch.start()
    a = orch.submit(TOK.encode("a", add_bos=False), SamplingParams(max_tokens=20, stop=("de",)))
    e_acute = TOK.encode("é", add_bos=False)
    b = orch.submit([e_acute[0] - 1], SamplingParams(max_tokens=4))
    tokens, text, last = a.collect()
    assert tokens == TOK.encode("bcde", add_bos=False) and text == "bc" and last.finish_reason == "stop"
    events = list(b)
    assert "".join(e.text for e in events) == "é😀"
    assert all("\ufffd" not in e.text for e in events)
    orch.stop(1.0)


@pytest.mark.parametrize(
    "prompt, sampling, match",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([5] * 60, SamplingParams(max_tokens=8), "exceeds the context length 64"),
        ([5], SamplingParams(temperature=-0.5), "temperature=-0.5 must be >= 0"),
        ([5], SamplingParams(top_p=1.5), "top_p=1.5 must be in"),
        ([5, 10_000], SamplingParams(), "outside the vocabulary"),
        ([5], SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
    ],
)
def test_submit_validates_before_queueing(prompt, sampling, match):
    _, orch = make()
    orch.start()
    with pytest.raises(ValueError, match=match):
        orch.submit(prompt, sampling)
    assert orch.stats()["num_waiting"] == 0
    orch.stop(0.5)


def test_queue_full_is_immediate():
    engine, orch = make(num_slots=1, max_queue=2, step_delay_s=0.01)
    orch.start()
    first = orch.submit([5], SamplingParams(max_tokens=50))
    wait_until(lambda: orch.stats()["num_running"] == 1)
    waiting = [orch.submit([6], SamplingParams(max_tokens=2)) for _ in range(2)]
    t0 = time.monotonic()
    with pytest.raises(QueueFull):
        orch.submit([7], SamplingParams(max_tokens=2))
    assert time.monotonic() - t0 < 0.5
    first.cancel()
    for h in waiting:
        assert h.collect()[2].finish_reason == "length"
    orch.stop(1.0)


def test_cancel_frees_the_slot_and_pages_within_one_step():
    engine, orch = make(num_slots=2, step_delay_s=0.005)
    orch.start()
    handle = orch.submit([5, 6], SamplingParams(max_tokens=60))
    seen = 0
    for event in handle:
        seen += len(event.token_ids)
        if seen >= 5:
            break
    # Read the step counter and cancel with no scheduling in between (the device thread plans steps
    # under this lock; a step planned just before may still be dispatched).
    with orch._cond:
        steps_at_cancel = engine.num_decode_steps
        handle.cancel()
    rest = list(handle)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].usage is not None
    stats = orch.stats()
    assert stats["num_free_slots"] == 2 and stats["finished"]["cancelled"] == 1
    assert stats["kv_pages_used"] == 0
    # At most the decode being dispatched while we cancelled still listed the request's slot.
    listing = [i for i, slots in enumerate(engine.decode_log, 1) if 0 in slots]
    assert listing and listing[-1] <= steps_at_cancel + 1
    handle.cancel()  # a second cancel is a no-op
    orch.stop(1.0)


def test_stop_finishes_short_requests_and_cancels_long_ones_after_grace():
    engine, orch = make(num_slots=2, step_delay_s=0.01)
    orch.start()
    short = orch.submit([5], SamplingParams(max_tokens=5, ignore_eos=True))
    long = orch.submit([6], SamplingParams(max_tokens=60, ignore_eos=True))
    wait_until(lambda: orch.stats()["num_running"] == 2)
    t0 = time.monotonic()
    orch.stop(grace_s=0.3)
    elapsed = time.monotonic() - t0
    assert 0.25 < elapsed < 2.0
    tokens, _, last = short.collect()
    assert last.finish_reason == "length" and len(tokens) == 5
    tokens, _, last = long.collect()
    assert last.finish_reason == "cancelled" and 0 < len(tokens) < 60
    with pytest.raises(NotAccepting):
        orch.submit([5], SamplingParams())
    assert orch.stats()["kv_pages_used"] == 0 and orch.stats()["num_free_slots"] == 2


def test_engine_failure_fails_fast():
    fatal = []
    engine = MockEngine(num_slots=2, vocab_size=TOK.vocab_size, fail_at_decode=4)
    orch = Orchestrator(engine, TOK, max_queue=4, on_fatal=fatal.append)
    orch.start()
    handle = orch.submit([5], SamplingParams(max_tokens=30, ignore_eos=True))
    tokens, _, last = handle.collect()
    assert last.finish_reason == "error"
    wait_until(lambda: fatal)
    assert isinstance(fatal[0], RuntimeError) and "injected failure" in str(fatal[0])
    with pytest.raises(NotAccepting):
        orch.submit([5], SamplingParams())
    assert orch.stats()["failed"]
    orch.stop(0.1)
