"""Speculative decoding: verification keeps greedy output token for token and sampled output in the
target's distribution; the scheduler advances each request by what its step accepted."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxinfer import generate as generate_module
from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import decode_attention_available
from jaxinfer.generate import generate
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.models.params import random_params
from jaxinfer.request import RequestError, SamplingParams
from jaxinfer.sampling import SlotSampling, filtered_probability, verify_drafts
from jaxinfer.scheduler import Scheduler
from jaxinfer.speculation.config import (
    DEFAULT_DRAFT_MIN_PROBABILITY,
    SpeculationConfig,
    default_max_rows,
    default_min_accepted,
    default_num_draft_tokens,
    server_config,
)
from jaxinfer.speculation.draft_heads import init_heads
from jaxinfer.speculation.gate import BatchGate, DraftGate
from jaxinfer.speculation.ngram import NgramIndex
from jaxinfer.speculation.step_costs import StepCosts
from jaxinfer.speculation.thresholds import HeldOutDrafts, best_thresholds
from jaxinfer.structured_output import ALLOW_ALL, mask_words
from jaxinfer.testing import FakeTokenizer, IdTokenizer, MockEngine, paged_cache_config
from tests.test_engine import GEMMA, LLAMA


def _settings(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed0: int = 0) -> SlotSampling:
    def vec(v, dtype):
        return jnp.full((n,), v, dtype)

    return SlotSampling(
        temperature=vec(temperature, jnp.float32), top_k=vec(top_k, jnp.int32),
        top_p=vec(top_p, jnp.float32), min_p=vec(0, jnp.float32), repetition_penalty=vec(1, jnp.float32),
        presence_penalty=vec(0, jnp.float32), frequency_penalty=vec(0, jnp.float32),
        num_logprobs=vec(-1, jnp.int32),
        seed=jnp.stack([jnp.zeros(n, jnp.uint32), seed0 + jnp.arange(n, dtype=jnp.uint32)], axis=1),
    )  # fmt: skip


def test_ngram_proposes_the_continuation_of_the_latest_match():
    tokens = [5, 6, 7, 8, 1, 2, 5, 6, 7, 9, 3, 5, 6, 7]
    assert NgramIndex(3, 2, tokens).propose(3) == [9, 3, 5]  # the latest "5 6 7", not the first
    assert NgramIndex(3, 2, tokens).propose(10) == [9, 3, 5, 6]  # a 3-token match drafts at most 4
    assert NgramIndex(4, 2, [1, 2, 3, 4, 5, 6, 9, 1, 2]).propose(4) == [3, 4, 5]  # a 2-token one, 3
    assert NgramIndex(3, 2, [1, 2, 1, 2]).propose(10) == [1, 2]  # up to the context's end
    assert NgramIndex(4, 2, [1, 2, 3, 4]).propose(3) == []
    assert NgramIndex(4, 2, [4, 4]).propose(3) == []
    with pytest.raises(ValueError):
        NgramIndex(2, 3)


def _lookup_by_search(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup written as a plain search back through the whole context."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):  # earlier occurrences, latest first
            if tokens[end - n : end] == suffix:
                return tokens[end : end + min(k, n + 1)]
    return []


@pytest.mark.parametrize("max_n, min_n", [(4, 2), (3, 1), (2, 2)])
def test_ngram_index_grown_token_by_token_proposes_what_a_search_finds(max_n, min_n):
    # A small vocabulary repeats n-grams often; the sequence runs past a few thousand tokens so a
    # match may lie far back.
    rng = np.random.default_rng(max_n * 10 + min_n)
    tokens = rng.integers(0, 12, 5000).tolist()
    index = NgramIndex(max_n, min_n, tokens[:40])
    for length in range(40, len(tokens) + 1):
        if length % 97 == 0 or length < 200 or length > len(tokens) - 50:
            want = _lookup_by_search(tokens[:length], 4, max_n, min_n)
            assert index.propose(4) == want, length
        if length < len(tokens):
            index.append(tokens[length])
    assert len(index) == len(tokens)


@pytest.mark.parametrize("min_n", [2, 3])
def test_ngram_index_knows_when_no_next_token_can_make_a_match(min_n):
    rng = np.random.default_rng(min_n)
    vocab = 24
    tokens = rng.integers(0, vocab, 300).tolist()
    answers = []
    for length in range(1, len(tokens)):
        index = NgramIndex(4, min_n, tokens[:length])
        may = index.may_match_after_next()
        answers.append(may)
        if not may:  # exact: no token whatever lets lookup propose
            assert all(NgramIndex(4, min_n, [*tokens[:length], x]).propose(3) == [] for x in range(vocab))
    assert 0 < answers.count(False) < len(answers)
    assert NgramIndex(4, 1, [7]).may_match_after_next()  # a single token may match anything


def _chi_square_p(observed: np.ndarray, p: np.ndarray) -> float:
    p = p.astype(np.float64)
    expected = p / p.sum() * observed.sum()
    return float(stats.chisquare(observed, expected).pvalue)


def _filtered_distribution(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The target distribution at temperature 0.9 after the filters, written out in numpy."""
    p = np.exp(logits / 0.9 - np.max(logits / 0.9))
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    mass = 0.0
    for rank, t in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[t], mass = True, mass + p[t]
    p = np.where(keep, p, 0)
    ids = jnp.arange(len(p), dtype=jnp.int32)
    rows = jnp.broadcast_to(jnp.asarray(logits), (len(p), len(p)))
    got = np.asarray(filtered_probability(rows, _settings(len(p), 0.9, top_k, top_p), ids))
    np.testing.assert_allclose(got, p / p.sum(), atol=1e-5)  # filtered_probability is that distribution
    return got


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7)])
def test_rejection_sampling_keeps_the_target_distribution(top_k, top_p):
    """Position 0's token over many seeds, with a fixed draft: chi-square against the filtered target
    distribution; the draft is accepted with exactly its target probability."""
    vocab, n, draft = 7, 40_000, 2
    rng = np.random.default_rng(0)
    one = rng.normal(size=(2, vocab)).astype(np.float32) * 1.5
    logits = jnp.broadcast_to(jnp.asarray(one), (n, 2, vocab))
    s = _settings(n, 0.9, top_k, top_p)
    drafts = jnp.full((n, 1), draft, jnp.int32)
    mask = jnp.full((n, mask_words(vocab)), ALLOW_ALL, jnp.int32)
    tokens, accepted = jax.jit(verify_drafts)(
        logits, drafts, jnp.zeros((n, vocab), jnp.int32), s, jnp.zeros(n, jnp.int32), mask
    )
    p = _filtered_distribution(one[0], top_k, top_p)
    assert abs(p.sum() - 1) < 1e-5
    observed = np.bincount(np.asarray(tokens[:, 0]), minlength=vocab)
    kept = p > 0
    assert observed[~kept].sum() == 0  # filtered-out tokens never appear
    assert _chi_square_p(observed[kept], p[kept]) > 1e-3
    rate = float(np.mean(np.asarray(accepted) > 0))
    assert abs(rate - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n) + 1e-9
    # After an accepted draft, position 1 is a plain draw from the second distribution.
    second = np.asarray(tokens[:, 1])[np.asarray(accepted) > 0]
    p1 = _filtered_distribution(one[1], top_k, top_p)
    observed1 = np.bincount(second, minlength=vocab)
    assert _chi_square_p(observed1[p1 > 0], p1[p1 > 0]) > 1e-3


def test_greedy_verification_accepts_the_argmax_chain():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 4, 11)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, axis=-1))
    drafts = np.array([best[0, :3], [best[1, 0], (best[1, 1] + 1) % 11, best[1, 2]], [-1, -1, -1]], np.int32)
    mask = jnp.full((3, mask_words(11)), ALLOW_ALL, jnp.int32)
    tokens, accepted = verify_drafts(
        logits,
        jnp.asarray(drafts),
        jnp.zeros((3, 11), jnp.int32),
        _settings(3, 0.0),
        jnp.zeros(3, jnp.int32),
        mask,
    )
    assert np.asarray(accepted).tolist() == [3, 1, 0]
    np.testing.assert_array_equal(np.asarray(tokens), best)


def _engine(
    config,
    k: int,
    heads: bool = False,
    slots: int = 4,
    kernels: KernelConfig | None = None,
    draft_min_probability: float | None = 0.0,
    out_scale: float = 1.0,
    held_out_drafts: HeldOutDrafts | None = None,
):
    params = random_params(config, seed=5)
    draft_heads = None
    if heads:
        vocab = np.arange(config.vocab_size, dtype=np.int32)
        draft_heads = init_heads(jax.random.key(0), config.hidden_size, 3, vocab, params["embed"] * out_scale)
    return JaxEngine(
        params,
        config,
        paged_cache_config(slots, 96, page_size=8),
        num_draft_tokens=k,
        draft_heads=draft_heads,
        kernels=kernels,
        draft_min_probability=draft_min_probability,
        held_out_drafts=held_out_drafts,
    )


def _verify_widths_of(engine: JaxEngine) -> list[int]:
    """The width of each verification step `engine` runs from now on, in order."""
    widths, run = [], engine._run

    def logged(key, *args):
        if key[0] == "verify":
            widths.append(key[3])
        return run(key, *args)

    engine._run = logged
    return widths


@pytest.mark.parametrize("method", ["ngram", "heads"])
@pytest.mark.parametrize("config", [LLAMA, GEMMA], ids=["llama", "gemma3"])
def test_greedy_speculation_gives_the_plain_tokens(config, method):
    """Greedy output with drafts verified equals plain decoding, token for token, for a batch of
    requests of different lengths (Gemma: past its sliding window), and some drafts were accepted."""
    rng = np.random.default_rng(2)
    motif = list(rng.integers(0, config.vocab_size, 6))
    prompts = [motif * 4, list(rng.integers(0, config.vocab_size, 11)), motif * 2 + [3, 4]]
    sampling = [SamplingParams(temperature=0, max_tokens=m) for m in (40, 25, 33)]
    tok = IdTokenizer(config.vocab_size)
    engine = _engine(config, 3, heads=method == "heads")  # without `speculation` it decodes plainly
    plain = generate(engine, tok, prompts, sampling)
    spec = SpeculationConfig(method=method, num_draft_tokens=3, min_accepted=0.0)
    fast = generate(engine, tok, prompts, sampling, speculation=spec)
    for a, b in zip(plain, fast):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
    assert sum(c.num_draft_tokens for c in fast) > 0
    if method == "ngram":  # a random model soon repeats itself: prompt lookup must hit
        assert sum(c.num_accepted_tokens for c in fast) > 0


def test_unsure_heads_verify_narrower_steps_and_keep_the_plain_tokens():
    """Heads that draft only what they are sure of: steps verify the narrowest width bucket holding
    their longest row of drafts (none: a one-token step that proposes; every width up to 4 is a
    bucket), every width was warmed up, and greedy output is still the plain output."""
    engine = _engine(LLAMA, 4, heads=True, draft_min_probability=0.9, out_scale=8.0)
    assert engine._verify_widths == (0, 1, 2, 3, 4)
    engine.warmup(prompt_lengths=[9, 14], max_new_tokens=40)
    compiled = engine.compile_count
    # Warm-up measured what each compiled width costs, for the scheduler's batch gate.
    costs = engine.step_costs
    assert set(costs.plain) == {1, 2} and set(costs.verify) == {(r, w) for r in (1, 2) for w in range(5)}
    assert costs.ratio(2, 3) == costs.verify[2, 3] / costs.plain[2] > 0
    assert not costs.head  # fixed thresholds: the heads are timed only to choose them
    engine.step_costs = None  # the widths below must not depend on this machine's timings
    widths = _verify_widths_of(engine)
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(0, LLAMA.vocab_size, n)) for n in (9, 14)]
    sampling = [SamplingParams(temperature=0, max_tokens=m) for m in (40, 31)]
    tok = IdTokenizer(LLAMA.vocab_size)
    plain = generate(engine, tok, prompts, sampling)
    assert widths == []  # no speculation: plain steps, the heads never run
    spec = SpeculationConfig(method="heads", num_draft_tokens=4, min_accepted=0.0)
    fast = generate(engine, tok, prompts, sampling, speculation=spec)
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    assert {0, 3} < set(widths)  # unsure steps, the heads' full depth and narrower ones
    assert engine.compile_count == compiled  # every width bucket was compiled by warmup()


def test_warm_up_chooses_the_draft_thresholds_and_changing_them_compiles_nothing():
    """Without thresholds given, warm-up prices the heads' held-out drafts at each row bucket's step
    costs it measured and drafts there at the best thresholds (thresholds.best_thresholds). Thresholds
    are an argument of the programs: setting others compiles nothing, the heads draft by them at once,
    and greedy output stays the plain output."""
    rng = np.random.default_rng(8)
    probability = rng.random((500, 3)).astype(np.float32)
    held_out = HeldOutDrafts(probability, np.sum(np.cumprod(rng.random((500, 3)) < probability, 1), 1))
    engine = _engine(LLAMA, 3, heads=True, draft_min_probability=None, held_out_drafts=held_out)
    assert engine.draft_min_probability == dict.fromkeys((1, 2, 4), DEFAULT_DRAFT_MIN_PROBABILITY)
    engine.warmup(prompt_lengths=[12, 12], max_new_tokens=30)  # measures the buckets of 1 and 2 rows
    assert set(engine.step_costs.head) == {1, 2}  # one depth of the heads, timed apart
    for rows in (1, 2):
        costs = [engine.step_costs.ratio(rows, n) for n in range(4)]
        head = engine.step_costs.head_ratio(rows)
        assert 0 < head < 1
        assert engine.draft_min_probability[rows] == best_thresholds(held_out, costs, rows, head)[0]
    assert engine.draft_min_probability[4] == DEFAULT_DRAFT_MIN_PROBABILITY  # not measured: as it was

    compiled = engine.compile_count
    tok = IdTokenizer(LLAMA.vocab_size)
    prompt = [list(rng.integers(0, LLAMA.vocab_size, 12))]
    sampling = [SamplingParams(temperature=0, max_tokens=30)]
    plain = generate(engine, tok, prompt, sampling)
    widths = _verify_widths_of(engine)
    no_lookup = dict(ngram_min=100, ngram_max=100)  # only the heads draft
    spec = SpeculationConfig(method="heads", num_draft_tokens=3, min_accepted=0.0, **no_lookup)
    for threshold, width in [(0.0, 3), (0.999, 0)]:  # random heads: always sure of 0, never of 0.999
        engine.set_draft_min_probability(threshold)
        assert engine.draft_min_probability == dict.fromkeys((1, 2, 4), (threshold,) * 3)
        widths.clear()
        (fast,) = generate(engine, tok, prompt, sampling, speculation=spec)
        assert fast.token_ids == plain[0].token_ids
        assert len(widths) > 10 and set(widths[:-2]) == {width}  # the last steps: fewer tokens left
    assert engine.compile_count == compiled
    engine.set_draft_min_probability((0.2, 0.5), rows=2)  # one bucket's alone
    assert (
        engine.draft_min_probability[2] == (0.2, 0.5, 0.5) and engine.draft_min_probability[1] == (0.999,) * 3
    )
    for bad in [dict(min_probability=1.5), dict(min_probability=0.5, rows=3)]:
        with pytest.raises(ValueError):
            engine.set_draft_min_probability(**bad)
    with pytest.raises(ValueError, match="no draft heads"):
        _engine(LLAMA, 3).set_draft_min_probability(0.5)


def test_heads_run_only_for_the_requests_that_draft_with_them():
    """Prompt lookup and heads requests in one batch: the prefill's and each step's heads propose for
    the heads request's row alone, a batch without one never runs them (no proposing steps of width
    0), and greedy output is the plain output either way."""
    engine = _engine(LLAMA, 3, heads=True, slots=2)
    rng = np.random.default_rng(5)
    motif = list(rng.integers(0, LLAMA.vocab_size, 5))
    prompts = [motif * 4, list(rng.integers(0, LLAMA.vocab_size, 12))]
    tok = IdTokenizer(LLAMA.vocab_size)
    plain = generate(engine, tok, prompts, [SamplingParams(temperature=0, max_tokens=30)] * 2)
    steps, prefills = [], {}
    run = engine._run

    def logged(key, *args):
        if key[0] == "verify":
            steps.append((key[3], np.asarray(args[-1]).copy()))
        if key[0] == "prefill_sample":  # (heads, hidden, chunk: slot, ..., drafting, ...)
            prefills[int(args[2][0])] = bool(args[2][5])
        return run(key, *args)

    engine._run = logged
    spec = SpeculationConfig(method="heads", num_draft_tokens=3, min_accepted=0.0)
    methods = ["ngram", "heads"]  # slot 0 drafts by prompt lookup, slot 1 with the heads
    sampling = [SamplingParams(temperature=0, max_tokens=30, speculative=m) for m in methods]
    mixed = generate(engine, tok, prompts, sampling, speculation=spec)
    assert [c.token_ids for c in mixed] == [c.token_ids for c in plain]
    assert prefills == {0: False, 1: True}  # the first drafts too: the heads request's alone
    assert steps and not any(drafting[0] for _, drafting in steps)
    assert any(drafting[1] for _, drafting in steps)
    steps.clear()
    sampling = [SamplingParams(temperature=0, max_tokens=30, speculative="ngram")] * 2
    lookup = generate(engine, tok, prompts, sampling, speculation=spec)
    assert [c.token_ids for c in lookup] == [c.token_ids for c in plain]
    assert steps and all(width > 0 and not drafting.any() for width, drafting in steps)


def test_heads_that_are_never_sure_pause_like_failing_drafts():
    """Heads that run every step but draft nothing cost each step their time for no tokens: after
    4 * k such steps the request stops running them for pause_steps steps (plain steps), then tries
    again; the output is still the plain output. Where prompt lookup matches, a heads request drafts
    by it instead (this tiny model's output repeats itself)."""
    engine = _engine(LLAMA, 4, heads=True, draft_min_probability=0.9)  # random heads: never that sure
    prompt = list(np.random.default_rng(6).integers(0, LLAMA.vocab_size, 10))
    tok = IdTokenizer(LLAMA.vocab_size)
    sampling = [SamplingParams(temperature=0, max_tokens=60)]
    plain = generate(engine, tok, [prompt], sampling)
    keys = []
    run = engine._run

    def logged(key, *args):
        if key[0] in ("decode", "verify"):
            keys.append(key[0] if key[0] == "decode" else key[3])
        return run(key, *args)

    engine._run = logged
    # Prompt lookup kept from matching (n-grams longer than the text), so only the heads could draft.
    no_lookup = dict(ngram_min=100, ngram_max=100)
    spec = SpeculationConfig(method="heads", num_draft_tokens=4, pause_steps=10, **no_lookup)
    (fast,) = generate(engine, tok, [prompt], sampling, speculation=spec)
    assert fast.token_ids == plain[0].token_ids and fast.num_draft_tokens == 0
    assert set(keys) == {0, "decode"}  # proposing steps, and plain ones while paused
    first_pause = keys.index("decode")
    assert first_pause == 4 * 4 - 1  # 16 empty proposals judged (the prefill's and 15 steps'), then paused
    assert keys[first_pause : first_pause + 10] == ["decode"] * 10 and 0 in keys[first_pause + 10 :]
    # With prompt lookup: its drafts are verified (widths above 0) and accepted, the tokens unchanged.
    keys.clear()
    spec = SpeculationConfig(method="heads", num_draft_tokens=4, pause_steps=10)
    (looked_up,) = generate(engine, tok, [prompt], sampling, speculation=spec)
    assert looked_up.token_ids == plain[0].token_ids
    assert looked_up.num_draft_tokens > 0 and looked_up.num_accepted_tokens > 0
    assert any(key not in (0, "decode") for key in keys)


def _mock_prompt(engine: MockEngine, sampling: SamplingParams, start: int, length: int) -> list[int]:
    """`length` tokens the mock model would produce from `start`, then its first three again: the last
    two tokens occurred before, followed by exactly what the model says next (prompt lookup hits)."""
    run = [start] + engine.reference_tokens(
        [start], SamplingParams(seed=sampling.seed, max_tokens=length - 1)
    )
    return run + run[:3]


@pytest.mark.parametrize("method", ["ngram", "heads"])
def test_speculating_requests_match_the_plain_tokens_and_free_everything(method):
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=3, max_seq_len=64, vocab_size=tok.vocab_size, max_draft_tokens=4,
                        draft_heads_depth=4 if method == "heads" else 0)  # fmt: skip
    rng = np.random.default_rng(0)
    prompts, sampling = [], []
    for _ in range(9):
        s = SamplingParams(
            seed=int(rng.integers(5)), max_tokens=int(rng.integers(1, 30)), stop_token_ids=tok.eos_ids
        )
        prompts.append(_mock_prompt(engine, s, int(rng.integers(tok.vocab_size)), int(rng.integers(4, 20))))
        sampling.append(s)
    spec = SpeculationConfig(method=method, num_draft_tokens=4, max_rows=3)
    results = generate(engine, tok, prompts, sampling, speculation=spec)
    for prompt, s, r in zip(prompts, sampling, results):
        assert r.token_ids == engine.reference_tokens(prompt, s)
    assert sum(r.num_accepted_tokens for r in results) > 0
    assert any(d for step in engine.draft_log for d in step.values())
    if method == "heads":  # every third head draft is wrong: some rejected, none past a rejection
        assert 0 < sum(r.num_accepted_tokens for r in results) < sum(r.num_draft_tokens for r in results)


def test_drafts_that_keep_failing_pause_and_resume():
    """Prompt lookup proposes a pattern the model does not follow: the request stops drafting for
    pause_steps decode steps, then tries again."""
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=200, vocab_size=tok.vocab_size, max_draft_tokens=2)
    s = SamplingParams(seed=0, max_tokens=60, stop_token_ids=tok.eos_ids)
    # The model continues with last + 1; the prompt says "5 6" is followed by 40 (and "6 40" by 5).
    prompt = [5, 6, 40] * 5 + [5, 6]
    spec = SpeculationConfig(method="ngram", num_draft_tokens=2, min_accepted=0.5, pause_steps=6, ngram_min=1)
    (result,) = generate(engine, tok, [prompt], [s], speculation=spec)
    assert result.token_ids == engine.reference_tokens(prompt, s)
    verify_steps = sum(1 for drafts in engine.draft_log if drafts)
    assert 0 < verify_steps < len(engine.decode_log) - 6  # paused for at least one spell of 6 steps
    assert result.num_draft_tokens > 0 and result.num_accepted_tokens < result.num_draft_tokens / 2


def test_a_paused_request_keeps_its_count_of_dispatched_tokens():
    """Heads sure of nothing beside prompt lookup that matches: the request is judged on the heads'
    empty proposals while lookup's drafts are verified, pauses at planning, and its next (plain) steps
    go out before the verification's result is read. The result must add its extra tokens to the
    dispatched count, not overwrite the count those steps added: else the request, once its pause
    ends, waits for ever for a count that never comes (the loop plans nothing)."""
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=200, vocab_size=tok.vocab_size, max_draft_tokens=2,
                        draft_heads_depth=2, heads_unsure=True)  # fmt: skip
    s = SamplingParams(seed=0, max_tokens=100, stop_token_ids=tok.eos_ids)
    prompt = _mock_prompt(engine, s, 3, 60)  # lookup drafts the model's next ~60 tokens right
    spec = SpeculationConfig(method="heads", num_draft_tokens=2, pause_steps=2, min_accepted=1.5)
    done = threading.Event()
    outcome = []
    threading.Thread(target=lambda: (outcome.append(generate(engine, tok, [prompt], [s], speculation=spec)),
                                     done.set()), daemon=True).start()  # fmt: skip
    assert done.wait(60), "the serving loop stopped planning"
    (result,) = outcome[0]
    assert result.token_ids == engine.reference_tokens(prompt, s)
    assert result.num_draft_tokens > 0


def test_heads_that_keep_failing_pause_while_prompt_lookup_drafts_on():
    """Each drafter has its own pause: heads sure of nothing stop running for a while, and prompt lookup,
    whose drafts the model keeps accepting, drafts on through their pause (one shared pause would stop
    both, and drop the lookup's accepted drafts with the heads' failures)."""
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=200, vocab_size=tok.vocab_size, max_draft_tokens=2,
                        draft_heads_depth=2, heads_unsure=True)  # fmt: skip
    s = SamplingParams(seed=0, max_tokens=50, stop_token_ids=tok.eos_ids)
    prompt = _mock_prompt(engine, s, 3, 60)  # lookup drafts the model's next tokens right
    spec = SpeculationConfig(method="heads", num_draft_tokens=2, pause_steps=4, min_accepted=1.5)
    (result,) = generate(engine, tok, [prompt], [s], speculation=spec)
    assert result.token_ids == engine.reference_tokens(prompt, s)
    steps = list(zip(engine.draft_log, engine.heads_log))
    assert all(drafts.get(0) for drafts, _ in steps[:-1])  # every step but the last verifies lookup's drafts
    assert any(0 in heads for _, heads in steps) and any(0 not in heads for _, heads in steps)
    assert result.num_accepted_tokens == result.num_draft_tokens > 0


def test_a_row_verifying_drafts_is_planned_again_only_after_its_result():
    """Prompt lookup misled by its prompt (every token followed by a wrong one: its gate stays shut
    after its first failures) and heads right two times in three, below min_accepted: their gate shuts
    right after a verification whose step also proposed the next drafts. Those drafts must not go out
    with both gates shut: the serving loop would then plan the row's next step before reading this one
    (its advance), at a stale length (the mock engine raises). Output stays the plain output."""
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=1, max_seq_len=400, vocab_size=tok.vocab_size, max_draft_tokens=3,
                        draft_heads_depth=3)  # fmt: skip
    s = SamplingParams(seed=0, max_tokens=80, stop_token_ids=tok.eos_ids)
    prompt = [t for v in range(0, tok.vocab_size, 2) for t in (v, (v + 5) % tok.vocab_size)]
    spec = SpeculationConfig(method="heads", num_draft_tokens=3, pause_steps=2, min_accepted=2.5,
                             ngram_min=1)  # fmt: skip
    (result,) = generate(engine, tok, [prompt], [s], speculation=spec)
    assert result.token_ids == engine.reference_tokens(prompt, s)
    assert any(0 not in heads for heads in engine.heads_log)  # the heads paused
    assert result.num_draft_tokens > result.num_accepted_tokens > 0


def test_lookup_that_cannot_match_lets_steps_go_out_before_the_last_is_read(monkeypatch):
    """While a request's last known token never occurred before, prompt lookup cannot match whatever
    token is in flight: its steps go out before the previous one is read, as without speculation, and
    it drafts exactly what a loop that reads every step first drafts."""
    tok = FakeTokenizer()
    s = SamplingParams(seed=0, max_tokens=40, stop_token_ids=tok.eos_ids)
    prompt = [20, 21, 22, 23, 24, 25, 14]  # the model counts up from 15 and meets 20-25 again
    spec = SpeculationConfig(method="ngram", num_draft_tokens=3, max_rows=1)

    def run():
        engine = MockEngine(num_slots=1, max_seq_len=128, vocab_size=tok.vocab_size, max_draft_tokens=3)
        (result,) = generate(engine, tok, [prompt], [s], speculation=spec)
        assert result.token_ids == engine.reference_tokens(prompt, s)
        return engine, (result.num_draft_tokens, result.num_accepted_tokens)

    engine, counts = run()
    monkeypatch.setattr(NgramIndex, "may_match_after_next", lambda self: True)  # always read first
    reading, reading_counts = run()
    assert engine.draft_log == reading.draft_log and any(engine.draft_log)
    assert counts == reading_counts and counts[1] > 0
    assert reading.max_unread_decodes == 1 < engine.max_unread_decodes


def test_speculation_stops_when_more_requests_decode_than_max_rows():
    tok = FakeTokenizer()
    engine = MockEngine(num_slots=4, max_seq_len=64, vocab_size=tok.vocab_size, max_draft_tokens=3)
    sampling = [SamplingParams(seed=1, max_tokens=m, stop_token_ids=tok.eos_ids) for m in (4, 7, 20, 24)]
    prompts = [_mock_prompt(engine, s, start, 8) for s, start in zip(sampling, (3, 9, 14, 20))]
    spec = SpeculationConfig(method="ngram", num_draft_tokens=3, max_rows=2)
    results = generate(engine, tok, prompts, sampling, speculation=spec)
    for prompt, s, r in zip(prompts, sampling, results):
        assert r.token_ids == engine.reference_tokens(prompt, s)
    verified = [listed for listed, drafts in zip(engine.decode_log, engine.draft_log) if drafts]
    assert verified  # it ran once two requests had finished
    assert all(len(listed) <= 2 for listed in verified)  # and only while at most two decoded


def _unsure_heads_pattern(slots: int, cost: float, measured: tuple[int, ...] = (1, 2, 4)) -> list[bool]:
    """`slots` requests with heads sure of nothing (each step that runs them costs `cost` plain steps
    and gives one token per row), per-request gates that never pause: whether the heads ran in each
    decode step. The scheduler counts the steps its batch gate kept plain."""
    schedulers = []

    class Counted(Scheduler):
        def __init__(self, **fields):
            super().__init__(**fields)
            schedulers.append(self)

    tok = FakeTokenizer()
    engine = MockEngine(num_slots=4, max_seq_len=200, vocab_size=tok.vocab_size, max_draft_tokens=2,
                        draft_heads_depth=2, heads_unsure=True)  # fmt: skip
    # Row buckets `measured` (a warm-up for one job measures only the buckets it needs).
    plain = {r: float(r) for r in measured}
    engine.step_costs = StepCosts(plain, {(r, w): cost * r for r in measured for w in (0, 1, 2)})
    sampling = [SamplingParams(seed=i, max_tokens=60, stop_token_ids=tok.eos_ids) for i in range(slots)]
    prompts = [[3 + 7 * i, 4 + 7 * i] for i in range(slots)]
    spec = SpeculationConfig(method="heads", num_draft_tokens=2, pause_steps=5, min_accepted=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generate_module, "Scheduler", Counted)
        results = generate(engine, tok, prompts, sampling, speculation=spec)
    for prompt, s, r in zip(prompts, sampling, results):
        assert r.token_ids == engine.reference_tokens(prompt, s)
    ran = [bool(heads) for heads in engine.heads_log]
    assert schedulers[0].num_batch_plain_steps == ran.count(False)
    return ran


def test_verification_steps_that_cost_the_batch_more_than_they_give_pause_it():
    """Two requests whose heads draft nothing: each verification step (the heads proposing) costs 1.25
    plain steps for one token per row. After BatchGate.MIN_STEPS such steps the batch decodes plainly
    for pause_steps steps, tries again for half as many steps, fails again and waits twice as long. The
    requests' own gates (min_accepted 0) never pause them: it is the batch gate that judges what the
    steps cost."""
    ran = _unsure_heads_pattern(2, cost=1.25)
    m = BatchGate.MIN_STEPS
    assert ran[: m + 5 + m // 2 + 10] == [True] * m + [False] * 5 + [True] * (m // 2) + [False] * 10
    # A step costing less than the tokens it gives keeps speculation on; one request alone is judged
    # by its own gates only.
    assert all(_unsure_heads_pattern(2, cost=0.95)[:-1])
    assert all(_unsure_heads_pattern(1, cost=1.25)[:-1])
    assert all(_unsure_heads_pattern(2, cost=1.25, measured=(1,))[:-1])  # a bucket not measured: no gate


def test_the_batch_gate_weighs_the_sums_of_recent_steps():
    """A run of losing steps inside steps that pay (a code edit's opening, then its repeated body) leaves
    the gate open where an average of each step's ratio would have shut it; steps that keep losing shut
    it after MIN_STEPS, and a retry that pays resets the doubling of the pause."""
    config = SpeculationConfig(pause_steps=5)
    gate = BatchGate()
    for tokens in (4, 4, 4, 20, 20, 20, 20, 20, 20, 4, 20, 20):  # 4 rows, each step costing 12 plain rows
        gate.judge(config, tokens, 12.0)
        assert gate.is_open
    losing = BatchGate()
    for _ in range(BatchGate.MIN_STEPS - 1):
        losing.judge(config, 8, 12.0)
    assert losing.is_open
    losing.judge(config, 8, 12.0)
    assert (losing.paused, losing.next_pause) == (5, 10)
    for _ in range(5):
        losing.tick()
    for _ in range(BatchGate.MIN_STEPS // 2):  # a retry is judged after half as many steps
        losing.judge(config, 20, 12.0)
    assert losing.is_open and losing.next_pause == 0


def test_step_costs_find_the_bucket_of_a_step():
    costs = StepCosts({1: 2.0, 4: 3.0}, {(1, 0): 2.2, (1, 2): 3.0, (1, 4): 4.0, (4, 2): 4.5, (4, 4): 6.0})
    assert costs.rows(1) == 1 and costs.rows(2) == costs.rows(4) == 4
    assert costs.ratio(1, 0) == pytest.approx(1.1) and costs.ratio(1, 3) == pytest.approx(2.0)
    assert costs.ratio(3, 1) == pytest.approx(1.5)  # 3 slots run in the bucket of 4, 1 draft in width 2
    assert costs.rows(5) is None and costs.ratio(5, 1) is None  # a job's warm-up measures its own buckets
    assert costs.ratio(4, 5) is None
    with pytest.raises(ValueError, match="different rows"):
        StepCosts({1: 2.0}, {(2, 1): 3.0})
    with pytest.raises(ValueError, match="positive"):
        StepCosts({1: 0.0}, {(1, 1): 3.0})


def test_a_servers_speculation_defaults_follow_its_backends_measurements(monkeypatch):
    from jaxinfer.cli import _runtime_options, build_parser
    from jaxinfer.cpu_kernels import native_build

    def options(*flags: str) -> SpeculationConfig:
        args = build_parser().parse_args(["generate", "--speculative", "ngram", *flags, "hello"])
        return _runtime_options(args).speculation

    def defaults() -> tuple:
        return default_max_rows(), default_num_draft_tokens(), default_min_accepted()

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    for isa, rows, drafts, pause in (
        (native_build.AVX512_VNNI, 4, 4, 0.2),
        (native_build.AVX_VNNI, 1, 4, 0.2),
        (native_build.AVX2, 1, 2, 0.5),
        (None, 1, 2, 0.5),
    ):
        monkeypatch.setattr(native_build, "best_isa", lambda isa=isa: isa)
        assert defaults() == (rows, drafts, pause), isa
        config = options()
        assert (config.max_rows, config.num_draft_tokens, config.min_accepted) == (rows, drafts, pause), isa
        assert options("--speculative-max-rows", "3").max_rows == 3  # the flags win
        assert options("--num-draft-tokens", "3").num_draft_tokens == 3
        assert server_config("heads", min_accepted=0.7).min_accepted == 0.7  # a script's own value wins
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert defaults() == (4, 4, 0.2)


def test_a_request_cannot_ask_for_what_the_server_lacks():
    tok = FakeTokenizer()
    engine = MockEngine(vocab_size=tok.vocab_size)
    with pytest.raises(RequestError, match="without speculative decoding"):
        generate(engine, tok, [[3, 4]], [SamplingParams(speculative="ngram")])
    with pytest.raises(RequestError, match="no draft heads"):
        generate(engine, tok, [[3, 4]], [SamplingParams(speculative="heads")],
                 speculation=SpeculationConfig(method="ngram"))  # fmt: skip
    with pytest.raises(RequestError, match="speculative"):
        SamplingParams(speculative="medusa").validate()


@pytest.mark.skipif(not decode_attention_available(), reason="the CPU lacks AVX2 or a compiler")
def test_greedy_speculation_with_the_native_kernels():
    """The native CPU path: each verified token attends as a decode row of its own, and the heads run
    in int8 through the VNNI kernel; greedy output is still the plain output."""
    native = KernelConfig(attention="native", matmul="native")
    rng = np.random.default_rng(3)
    motif = list(rng.integers(0, LLAMA.vocab_size, 5))
    prompts = [motif * 5, motif * 2 + [7]]
    sampling = [SamplingParams(temperature=0, max_tokens=m) for m in (36, 29)]
    tok = IdTokenizer(LLAMA.vocab_size)
    engine = _engine(LLAMA, 4, heads=True, kernels=native)
    plain = generate(engine, tok, prompts, sampling)
    for method in ("ngram", "heads"):
        spec = SpeculationConfig(method=method, num_draft_tokens=4, min_accepted=0.0)
        fast = generate(engine, tok, prompts, sampling, speculation=spec)
        assert [c.token_ids for c in fast] == [c.token_ids for c in plain], method
        assert sum(c.num_draft_tokens for c in fast) > 0


def test_the_pause_prices_a_narrow_step_by_its_width():
    """One draft accepted every other step keeps drafting (a 1-draft verification costs little), where
    k drafts of which every other step accepts one pause: the average is per full-width step."""
    spec = SpeculationConfig(method="ngram", num_draft_tokens=4, min_accepted=0.5)
    for drafts, paused in ((1, False), (4, True)):
        gate = DraftGate()
        for step in range(40):
            gate.judge(spec, drafts, step % 2)  # accepts 0, 1, 0, 1, ...
            if not gate.is_open:
                break
        assert gate.is_open is not paused, drafts
