"""Scheduler policy: admission, chunked prefill under a budget, slot freeing, stops, invariants.

Steps are driven by hand against MockEngine, which checks the engine contract (chunk positions, distinct
slots) and whose tokens `MockEngine.reference_tokens` computes independently.
"""

import collections
import random

import pytest

from jaxinfer.request import SamplingParams
from jaxinfer.scheduler import QueueFull, RequestStatus, Scheduler, dispatch
from jaxinfer.testing import FakeTokenizer, MockEngine


def make(engine, *, max_queue=16, budget=None, tokenizer=None, prefix_caching=True):
    return Scheduler(
        num_slots=engine.num_slots,
        max_seq_len=engine.max_seq_len,
        max_prefill_chunk=engine.max_prefill_chunk,
        page_size=engine.page_size,
        num_pages=engine.num_pages,
        max_queue=max_queue,
        prefill_token_budget=budget,
        enable_prefix_caching=prefix_caching,
        detokenizer_factory=(tokenizer or FakeTokenizer()).detokenizer,
    )


def drive(scheduler, engine, *, pipelined=True, before_step=None, min_steps=0, max_steps=10_000):
    """Runs steps until idle; returns {request_id: (tokens, text, finish_reason)} and the step plans.

    pipelined: read step n's results only after dispatching step n+1, as the orchestrator does.
    before_step(step_index): a hook for cancellations and late arrivals.
    """
    tokens, texts, reasons = collections.defaultdict(list), collections.defaultdict(str), {}
    plans = []
    in_flight = None

    def credit(outputs):
        for out in outputs:
            assert out.request_id not in reasons, "output after the final one"
            tokens[out.request_id] += out.new_token_ids
            texts[out.request_id] += out.new_text
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
                assert out.num_output_tokens == len(tokens[out.request_id])

    for i in range(max_steps):
        if before_step is not None:
            credit(before_step(i))
        if not scheduler.has_work() and in_flight is None:
            if i >= min_steps:
                break
            continue
        plan = scheduler.schedule()
        plans.append(plan)
        step = dispatch(engine, plan)
        if not pipelined:
            in_flight, step = step, None
        if in_flight is not None:
            credit(scheduler.update_from_output(in_flight.plan, *in_flight.results()))
        in_flight = step
    else:
        raise AssertionError("did not finish")
    return {rid: (tokens[rid], texts[rid], reasons[rid]) for rid in reasons}, plans


def test_admission_is_fifo_into_lowest_free_slots_and_queue_is_bounded():
    engine = MockEngine(num_slots=2, max_prefill_chunk=8)
    sched = make(engine, max_queue=3, budget=64)
    for i in range(3):
        sched.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(QueueFull):
        sched.add_request("r3", [5], SamplingParams())
    plan = sched.schedule()
    assert plan.admitted_request_ids == ("r0", "r1")
    assert [c.slot for c in plan.prefill_chunks] == [0, 1]
    assert sched.get("r2").status is RequestStatus.WAITING and sched.num_waiting == 1
    sched.add_request("r3", [5], SamplingParams())  # two admitted: room for two more waiting
    sched.add_request("r4", [5], SamplingParams())
    with pytest.raises(QueueFull):
        sched.add_request("r5", [5], SamplingParams())


@pytest.mark.parametrize(
    "engine, prompt, max_tokens, match",
    [
        (MockEngine(max_seq_len=64), [1] * 60, 5, "exceed max_seq_len=64"),
        (MockEngine(max_seq_len=64, num_pages=3), [1] * 20, 5, "the whole pool has 2"),
    ],
)
def test_add_request_rejects_what_the_cache_cannot_hold(engine, prompt, max_tokens, match):
    sched = make(engine)
    with pytest.raises(ValueError, match=match):
        sched.add_request("bad", prompt, SamplingParams(max_tokens=max_tokens))
    assert sched.num_waiting == 0 and sched.num_live == 0


def test_duplicate_live_request_id_is_rejected():
    sched = make(MockEngine())
    sched.add_request("a", [1], SamplingParams())
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request("a", [2], SamplingParams())


def test_long_prompt_is_chunked_and_decodes_only_after_the_last_chunk():
    engine = MockEngine(num_slots=2, max_seq_len=64, max_prefill_chunk=8)
    sched = make(engine)
    prompt = list(range(4, 24))  # 20 tokens -> 8 + 8 + 4
    sched.add_request("long", prompt, SamplingParams(max_tokens=3, seed=1))
    results, plans = drive(sched, engine)
    chunks = [(c.start, len(c.token_ids), c.is_last) for p in plans for c in p.prefill_chunks]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    first_last = next(i for i, p in enumerate(plans) if any(c.is_last for c in p.prefill_chunks))
    assert not any(p.decode_batch is not None for p in plans[:first_last])
    only_last = [c for p in plans for c in p.prefill_chunks if c.is_last]
    assert tuple(only_last[0].prompt_token_ids) == tuple(prompt)
    sampling = SamplingParams(max_tokens=3, seed=1)
    assert results["long"] == (engine.reference_tokens(prompt, sampling), results["long"][1], "length")


def test_prefill_budget_spreads_a_long_prompt_while_running_requests_keep_decoding():
    engine = MockEngine(num_slots=3, max_seq_len=128, max_prefill_chunk=8)
    sched = make(engine, budget=10)
    sched.add_request("short", [4, 5, 6], SamplingParams(max_tokens=30))
    sched.add_request("long", list(range(4, 44)), SamplingParams(max_tokens=2))  # 40 tokens
    results, plans = drive(sched, engine)
    per_step = [sum(len(c.token_ids) for c in p.prefill_chunks) for p in plans]
    assert max(per_step) <= 10
    assert all(len(c.token_ids) <= 8 for p in plans for c in p.prefill_chunks)
    # Step 1: "short" whole (3) + 7 of "long"; then "long" continues at most 8 per step.
    assert [(c.slot, c.start, len(c.token_ids)) for c in plans[0].prefill_chunks] == [(0, 0, 3), (1, 0, 7)]
    long_steps = [i for i, p in enumerate(plans) if any(c.slot == 1 for c in p.prefill_chunks)]
    assert len(long_steps) == 6  # 7 + 8*4 + 1
    # "short" decodes in every one of those steps: a long prompt does not stall a running stream.
    assert all(plans[i].decode_batch is not None and 0 in plans[i].decode_owners for i in long_steps[1:])
    for rid, prompt, sp in [
        ("short", [4, 5, 6], SamplingParams(max_tokens=30)),
        ("long", list(range(4, 44)), SamplingParams(max_tokens=2)),
    ]:
        assert results[rid][0] == engine.reference_tokens(prompt, sp)


@pytest.mark.parametrize("pipelined", [False, True])
def test_many_requests_match_reference_and_free_every_slot(pipelined):
    rng = random.Random(0)
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=3, max_seq_len=48, max_prefill_chunk=5, vocab_size=tok.vocab_size)
    sched = make(engine, max_queue=32, budget=7, tokenizer=tok)
    requests = {}
    for i in range(20):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 20))]
        sampling = SamplingParams(
            seed=rng.randrange(5), max_tokens=rng.randint(1, 48 - len(prompt)), stop_token_ids=tok.eos_ids
        )
        requests[f"r{i}"] = (prompt, sampling)
        sched.add_request(f"r{i}", prompt, sampling)
    results, plans = drive(sched, engine, pipelined=pipelined)
    assert set(results) == set(requests)
    for rid, (prompt, sampling) in requests.items():
        expected = engine.reference_tokens(prompt, sampling)
        tokens, text, reason = results[rid]
        assert tokens == expected, rid
        assert text == tok.decode(expected)
        assert reason == ("stop" if expected[-1] in tok.eos_ids else "length")
    assert sched.num_free_slots == 3 and sched.num_live == 0 and sched.pool.num_used == 0


def ids(tok, text):
    return tok.encode(text, add_bos=False)


def test_stop_string_truncates_text_holds_back_prefixes_and_frees_the_slot():
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=64, vocab_size=tok.vocab_size)
    sched = make(engine, tokenizer=tok)
    # seed 0 walks consecutive ASCII ids: after "a" come "b", "c", "d", "e", ...
    sched.add_request("s", ids(tok, "a"), SamplingParams(max_tokens=20, stop=("de", "zz")))
    sched.add_request("next", ids(tok, "A"), SamplingParams(max_tokens=3))
    results, plans = drive(sched, engine)
    tokens, text, reason = results["s"]
    assert tokens == ids(tok, "bcde") and text == "bc" and reason == "stop"
    # The slot and the pages went straight to the next request.
    admitted = next(p for p in plans if p.admitted_request_ids == ("next",))
    assert [c.slot for c in admitted.prefill_chunks] == [0]
    assert results["next"][0] == ids(tok, "BCD")


def test_text_never_shows_part_of_a_stop_string():
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=64, vocab_size=tok.vocab_size)
    sched = make(engine, tokenizer=tok)
    sched.add_request("s", ids(tok, "a"), SamplingParams(max_tokens=6, stop=("cdX",)))
    streamed = []
    in_flight = None
    while sched.has_work() or in_flight:
        plan = sched.schedule()
        p = engine.prefill(plan.prefill_chunks) if plan.prefill_chunks else None
        d = engine.decode(plan.decode_batch) if plan.decode_batch is not None else None
        for out in sched.update_from_output(plan, p and p.result(), d and d.result()):
            streamed.append(out.new_text)
        in_flight = None
    # Step 1 samples "b" (prefill) and "c" (decode): "b" streams, "c" could start "cdX" and waits;
    # so does "cd" after step 2, until "e" rules it out.
    assert streamed == ["b", "", "cde", "f", "g"]
    assert "".join(streamed) == tok.decode(ids(tok, "bcdefg"))


def test_multibyte_character_split_across_tokens_is_never_broken():
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=64, vocab_size=tok.vocab_size)
    sched = make(engine, tokenizer=tok)
    e_acute = ids(tok, "é")
    assert len(e_acute) == 2  # the FakeTokenizer splits it across two tokens
    prompt = [e_acute[0] - 1]  # seed 0 -> the two halves of "é" come next, then "😀" in two halves
    sched.add_request("u", prompt, SamplingParams(max_tokens=4))
    streamed = []
    while sched.has_work():
        plan = sched.schedule()
        p = engine.prefill(plan.prefill_chunks) if plan.prefill_chunks else None
        d = engine.decode(plan.decode_batch) if plan.decode_batch is not None else None
        streamed += [o.new_text for o in sched.update_from_output(plan, p and p.result(), d and d.result())]
    # Step 1 samples both halves of "é" (prefill + decode); step 2 only half of "😀": nothing to show.
    assert streamed == ["é", "", "😀"]


def test_finish_request_frees_the_slot_at_once_and_drops_the_speculative_token():
    engine = MockEngine(num_slots=1, max_seq_len=64)
    sched = make(engine)
    sched.add_request("a", [3], SamplingParams(max_tokens=40))
    sched.add_request("b", [9], SamplingParams(max_tokens=3, seed=2))

    def on_step(i):
        if i == 4:  # "a" holds slot 0 and has a decode in flight
            out = sched.finish_request("a", "cancelled")
            assert sched.num_free_slots == 1  # free on the host at once
            return [out]
        return []

    results, plans = drive(sched, engine, before_step=on_step)
    cancel_plan = plans[4]
    # The very next step no longer decodes "a"; its slot goes to the waiting request.
    assert all(seq.request_id != "a" for seq, _ in cancel_plan.decode_owners.values())
    assert cancel_plan.admitted_request_ids == ("b",)
    assert [c.slot for c in cancel_plan.prefill_chunks] == [0]
    a_tokens, _, a_reason = results["a"]
    full = engine.reference_tokens([3], SamplingParams(max_tokens=40))
    assert a_reason == "cancelled" and a_tokens == full[: len(a_tokens)]
    # Steps 0-2 were read before the cancel (prefill + decode in step 0, then one each): 4 tokens.
    # Step 3's decode, in flight at the cancel, sampled one more for "a": it is dropped, and "b",
    # now in that slot, gets exactly its own tokens.
    assert len(a_tokens) == 4
    assert results["b"][0] == engine.reference_tokens([9], SamplingParams(max_tokens=3, seed=2))
    assert sched.finish_request("a", "cancelled") is None  # already finished: a no-op


def _random_load(sched, engine, rng, *, steps, make_prompt, cancel_rate, check_step=lambda: None):
    """For `steps` steps, 0-2 arrivals (make_prompt() prompts, max_tokens up to the context) and a cancel
    of a random live request with probability cancel_rate; then drives to idle.
    -> (results, {request_id: (prompt, sampling)} of the accepted requests, cancelled ids)."""
    submitted, cancelled = {}, set()
    counter = iter(range(10_000))

    def on_step(i):
        outs = []
        if i < steps:
            for _ in range(rng.randint(0, 2)):
                prompt = make_prompt()
                seed = rng.randrange(3)  # drawn before max_tokens
                max_tokens = rng.randint(1, engine.max_seq_len - len(prompt))
                sampling = SamplingParams(seed=seed, max_tokens=max_tokens)
                rid = f"r{next(counter)}"
                try:
                    sched.add_request(rid, prompt, sampling)
                    submitted[rid] = (prompt, sampling)
                except QueueFull:
                    pass
            live = [rid for rid in submitted if sched.get(rid) is not None]
            if live and rng.random() < cancel_rate:
                rid = rng.choice(live)
                cancelled.add(rid)
                outs.append(sched.finish_request(rid, "cancelled"))
        check_step()
        return outs

    results, _ = drive(sched, engine, before_step=on_step, min_steps=steps)
    return results, submitted, cancelled


def test_random_arrivals_and_cancels_keep_invariants_and_leak_no_slot():
    rng = random.Random(1)
    engine = MockEngine(num_slots=4, max_seq_len=40, max_prefill_chunk=6)
    sched = make(engine, max_queue=8, budget=9)

    def check_step():
        busy = sched.num_slots - sched.num_free_slots
        assert 0 <= busy <= sched.num_slots and sched.num_waiting <= 8

    results, submitted, cancelled = _random_load(
        sched, engine, rng, steps=150, cancel_rate=0.2, check_step=check_step,
        make_prompt=lambda: [rng.randrange(32) for _ in range(rng.randint(1, 25))],
    )  # fmt: skip
    assert set(results) == set(submitted) and len(submitted) > 40
    for rid, (prompt, sampling) in submitted.items():
        expected = engine.reference_tokens(prompt, sampling)
        tokens, _, reason = results[rid]
        if rid in cancelled:
            assert reason == "cancelled" and tokens == expected[: len(tokens)]
        else:
            assert tokens == expected and reason == "length"
    assert sched.num_free_slots == 4 and sched.num_tokens_held() == 0
    assert sched.pool.num_used == 0
    sched.pool.check()


def test_host_side_max_tokens_backstop_releases_the_slot():
    """If a device failed to flag the max_tokens-th token as done, the host ends the request itself."""

    class ForgetfulEngine(MockEngine):
        def _sample_into(self, out, slot, mask=None):
            super()._sample_into(out, slot, mask)
            out.done[slot] = False
            self._slots[slot].active = True

    engine = ForgetfulEngine(num_slots=1)
    sched = make(engine)
    sched.add_request("a", [1], SamplingParams(max_tokens=3))
    results, plans = drive(sched, engine)
    assert results["a"][0] == engine.reference_tokens([1], SamplingParams(max_tokens=3))
    assert results["a"][2] == "length"
    # The device still thinks the slot is active; the host stops listing it and frees its pages.
    assert sched.num_free_slots == 1 and sched.pool.num_used == 0
    assert len(plans[-1].decode_owners) <= 1 and engine.num_decode_steps <= 3


# ---- pages: prefix caching, admission by memory, preemption ----------------------------------------


def _run_all(engine, requests, *, prefix_caching=True, one_by_one=False, pipelined=True):
    """Submits requests {rid: (prompt, sampling)} (all at once, or each after the previous finished) and
    drives them; returns (results, scheduler)."""
    sched = make(engine, max_queue=64, prefix_caching=prefix_caching)
    results = {}
    if one_by_one:
        for rid, (prompt, sampling) in requests.items():
            sched.add_request(rid, prompt, sampling)
            results.update(drive(sched, engine, pipelined=pipelined)[0])
    else:
        for rid, (prompt, sampling) in requests.items():
            sched.add_request(rid, prompt, sampling)
        results = drive(sched, engine, pipelined=pipelined)[0]
    sched.pool.check()
    assert sched.pool.num_used == 0 and sched.num_tokens_held() == 0
    return results, sched


def test_prefix_caching_skips_shared_pages_and_changes_no_token():
    document = [(7 * i + 3) % 32 for i in range(21)]  # 5 full pages of 4, and one token more
    requests = {
        f"q{i}": (document + [i, (i + 5) % 32, 9], SamplingParams(seed=i % 3, max_tokens=6)) for i in range(6)
    }
    runs = {}
    for caching in (True, False):
        engine = MockEngine(num_slots=3, max_seq_len=48, max_prefill_chunk=8)
        results, sched = _run_all(engine, requests, prefix_caching=caching, one_by_one=True)
        runs[caching] = (results, sched, engine)
    (cached, sched_on, engine_on), (plain, sched_off, engine_off) = runs[True], runs[False]
    assert cached == plain
    for rid, (prompt, sampling) in requests.items():
        assert cached[rid][0] == engine_on.reference_tokens(prompt, sampling)
    # Every request after the first finds the document's 5 full pages (the 6th page differs).
    assert sched_on.prefix_hit_tokens == 5 * 20 and sched_on.prefix_query_tokens == 6 * 24
    assert engine_off.num_prefill_tokens - engine_on.num_prefill_tokens == 5 * 20
    assert sched_off.prefix_hit_tokens == 0


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer():
    engine = MockEngine(num_slots=2, max_seq_len=64, max_prefill_chunk=8)
    sched = make(engine)
    prompt, sampling = [5, 1, 4, 1, 5, 9, 2], SamplingParams(seed=1, max_tokens=10)
    sched.add_request("turn1", prompt, sampling)
    [(answer, _, _)] = drive(sched, engine)[0].values()
    follow_up = prompt + answer + [3, 3, 3]
    sched.add_request("turn2", follow_up, sampling)
    outputs = []
    plans = []
    while sched.has_work():
        plan = sched.schedule()
        plans.append(plan)
        outputs += sched.update_from_output(plan, *dispatch(engine, plan).results())
    assert [t for o in outputs for t in o.new_token_ids] == engine.reference_tokens(follow_up, sampling)
    # Turn 1 computed positions 0-15 (prompt and all but the last answer token): 4 full pages.
    assert outputs[-1].num_cached_tokens == 16
    assert sum(len(c.token_ids) for p in plans for c in p.prefill_chunks) == len(follow_up) - 16


def test_a_request_waits_for_pages_and_one_larger_than_the_pool_is_refused():
    engine = MockEngine(num_slots=4, max_seq_len=64, max_prefill_chunk=16, num_pages=5)  # 4 pages of 4
    sched = make(engine, prefix_caching=False)
    with pytest.raises(ValueError, match="the whole pool has 4"):
        sched.add_request("big", list(range(10)), SamplingParams(max_tokens=7))  # 17 positions
    assert sched.num_waiting == 0
    sched.add_request("a", list(range(12)), SamplingParams(max_tokens=2))
    sched.add_request("b", list(range(12, 24)), SamplingParams(max_tokens=2))
    first = sched.schedule()
    assert first.admitted_request_ids == ("a",) and sched.get("b").status is RequestStatus.WAITING
    outputs = sched.update_from_output(first, *dispatch(engine, first).results())
    finished = {o.request_id for o in outputs if o.finish_reason is not None}
    results, plans = drive(sched, engine)
    assert finished | set(results) == {"a", "b"}
    assert "b" in {r for p in plans for r in p.admitted_request_ids}
    assert sched.num_preemptions == 0 and sched.pool.num_used == 0


@pytest.mark.parametrize("pipelined", [True, False])
def test_preemption_recomputes_and_streams_every_token_once(pipelined):
    """12 usable pages, 4 requests that each grow to 9: the newest are preempted and resumed, and every
    stream still equals its reference (no token lost or repeated)."""
    engine = MockEngine(num_slots=4, max_seq_len=40, max_prefill_chunk=8, num_pages=13)
    requests = {
        f"r{i}": ([i, 2 * i + 1, 3, 4, 5, i], SamplingParams(seed=i, max_tokens=30)) for i in range(4)
    }
    for caching in (True, False):
        results, sched = _run_all(engine, requests, prefix_caching=caching, pipelined=pipelined)
        assert sched.num_preemptions > 0
        for rid, (prompt, sampling) in requests.items():
            tokens, _, reason = results[rid]
            assert tokens == engine.reference_tokens(prompt, sampling) and reason == "length"


def test_random_load_with_cancels_and_a_small_pool_leaks_no_page():
    rng = random.Random(7)
    engine = MockEngine(num_slots=6, max_seq_len=48, max_prefill_chunk=8, num_pages=25)
    sched = make(engine, max_queue=16, budget=12)
    shared = [rng.randrange(32) for _ in range(12)]

    def make_prompt():
        head = shared if rng.random() < 0.5 else []
        return head + [rng.randrange(32) for _ in range(rng.randint(1, 14))]

    results, submitted, cancelled = _random_load(
        sched, engine, rng, steps=300, cancel_rate=0.25, make_prompt=make_prompt
    )
    assert set(results) == set(submitted) and len(submitted) > 100
    assert sched.num_preemptions > 0 and sched.prefix_hit_tokens > 0
    for rid, (prompt, sampling) in submitted.items():
        expected = engine.reference_tokens(prompt, sampling)
        tokens, _, reason = results[rid]
        assert tokens == expected[: len(tokens)] if rid in cancelled else tokens == expected
    assert sched.pool.num_used == 0 and sched.num_free_slots == 6
    sched.pool.check()


def test_requests_arriving_together_over_one_document_prefill_it_once():
    """The first request prefills the document in chunks; the others wait for its pages instead of
    computing them too, while a request with another prompt goes ahead of them."""
    document = [(5 * i + 1) % 32 for i in range(21)]
    requests = {f"q{i}": (document + [i, (i + 3) % 32, 9], SamplingParams(max_tokens=3)) for i in range(6)}
    requests["other"] = ([31, 30, 29], SamplingParams(max_tokens=3))
    engine = MockEngine(num_slots=8, max_seq_len=48, max_prefill_chunk=8)
    sched = make(engine, budget=12)  # room for more than q0's chunk in each step
    for rid, (prompt, sampling) in requests.items():
        sched.add_request(rid, prompt, sampling)
    results, plans = drive(sched, engine)
    for rid, (prompt, sampling) in requests.items():
        assert results[rid][0] == engine.reference_tokens(prompt, sampling)
    # The document's 5 full pages are computed once: 24 tokens for q0, 4 for each other question, 3.
    assert engine.num_prefill_tokens == 24 + 5 * 4 + 3
    admitted = [rid for plan in plans for rid in plan.admitted_request_ids]
    assert admitted.index("other") < admitted.index("q1")
    assert sched.pool.num_used == 0
