"""Device-side sampling: each filter against its definition, penalties against transformers' processors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from jaxinfer.request import SamplingParams
from jaxinfer.sampling import (
    SlotSampling,
    apply_penalties,
    apply_token_mask,
    greedy_tokens,
    sample,
    split_seed,
    token_logprobs,
    verify_drafts,
)
from jaxinfer.structured_output import allow_all, mask_words

VOCAB = 50


def _settings(n: int, **overrides) -> SlotSampling:
    base = dict(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
        frequency_penalty=0.0, num_logprobs=-1,
    )  # fmt: skip
    base |= overrides
    ints = ("top_k", "num_logprobs")
    arrays = {k: jnp.full((n,), v, jnp.int32 if k in ints else jnp.float32) for k, v in base.items()}
    return SlotSampling(**arrays, seed=jnp.zeros((n, 2), jnp.uint32))


def _allow_all(rows: int, vocab: int) -> jax.Array:
    return jnp.asarray(allow_all(rows, mask_words(vocab)))


def _draw(logits: np.ndarray, draws: int, mask: np.ndarray | None = None, **overrides) -> np.ndarray:
    """`draws` samples from one row of logits, one per seed (under one token mask row if given)."""
    s = _settings(draws, **overrides)
    seeds = jnp.stack([jnp.zeros(draws, jnp.uint32), jnp.arange(draws, dtype=jnp.uint32)], 1)
    s = dataclasses.replace(s, seed=seeds)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (draws, logits.shape[-1]))
    counts = jnp.zeros(rows.shape, jnp.int32)
    masks = (
        _allow_all(draws, logits.shape[-1]) if mask is None else jnp.broadcast_to(mask, (draws, len(mask)))
    )
    return np.asarray(jax.jit(sample)(rows, counts, s, jnp.zeros(draws, jnp.int32), masks))


@pytest.fixture(scope="module")
def logits():
    return np.random.default_rng(0).normal(size=VOCAB).astype(np.float32) * 2


def test_greedy_is_argmax_and_independent_of_seed(logits):
    tokens = _draw(logits, 64, temperature=0.0)
    assert (tokens == np.argmax(logits)).all()


def test_temperature_sampling_follows_softmax(logits):
    draws = 4000
    tokens = _draw(logits, draws, temperature=1.5)
    probs = np.exp(logits / 1.5 - np.max(logits / 1.5))
    probs /= probs.sum()
    freq = np.bincount(tokens, minlength=VOCAB) / draws
    # total variation distance between the empirical and the true distribution
    assert 0.5 * np.abs(freq - probs).sum() < 0.06


def test_top_k_keeps_exactly_the_k_most_likely(logits):
    tokens = _draw(logits, 2000, temperature=3.0, top_k=5)
    allowed = set(np.argsort(logits)[-5:])
    assert set(tokens) == allowed


def test_top_p_keeps_the_smallest_nucleus(logits):
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    nucleus = set(order[mass_before < 0.6])
    tokens = _draw(logits, 2000, top_p=0.6)
    assert set(tokens) == nucleus


def test_min_p_drops_tokens_below_the_fraction_of_the_top(logits):
    probs = np.exp(logits - logits.max())
    allowed = set(np.flatnonzero(probs >= 0.2))
    tokens = _draw(logits, 2000, min_p=0.2)
    assert set(tokens) == allowed


def test_penalties_match_transformers_processors(logits):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    seen_ids = [3, 7, int(np.argmax(logits)), 20, 7, 7]
    counts = np.bincount(seen_ids, minlength=VOCAB)[None].astype(np.int32)
    s = _settings(1, repetition_penalty=1.3, presence_penalty=0.0)
    ours = np.asarray(apply_penalties(jnp.asarray(logits[None]), jnp.asarray(counts), s))
    processor = RepetitionPenaltyLogitsProcessor(1.3)
    expected = processor(torch.tensor([seen_ids]), torch.tensor(logits[None])).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-6)

    # OpenAI's definition: logit - count * frequency_penalty - (count > 0) * presence_penalty.
    s = _settings(1, presence_penalty=0.75, frequency_penalty=-0.4)
    ours = np.asarray(apply_penalties(jnp.asarray(logits[None]), jnp.asarray(counts), s))
    np.testing.assert_allclose(ours, logits[None] - 0.75 * (counts > 0) + 0.4 * counts, rtol=1e-6)
    s = _settings(1)  # no penalty: the logits pass through
    np.testing.assert_array_equal(
        apply_penalties(jnp.asarray(logits[None]), jnp.asarray(counts), s), logits[None]
    )


def _mask_of(allowed: np.ndarray) -> np.ndarray:
    """[rows, vocab] bool -> [rows, words] int32 bitmasks (bit i of word w: token 32 * w + i)."""
    rows, vocab = allowed.shape
    bits = np.zeros((rows, mask_words(vocab) * 32), bool)
    bits[:, :vocab] = allowed
    return np.packbits(bits.reshape(rows, -1, 32)[:, :, ::-1], axis=2).view(">u4")[..., 0].astype(np.int32)


@pytest.mark.parametrize("vocab", [50, 97, 600])
def test_token_mask_keeps_exactly_the_allowed_tokens(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=vocab).astype(np.float32)
    allowed = rng.random(vocab) < 0.2
    allowed[rng.integers(vocab)] = True
    mask = _mask_of(allowed[None])[0]
    masked = np.asarray(apply_token_mask(jnp.asarray(logits[None]), jnp.asarray(mask[None])))[0]
    np.testing.assert_array_equal(np.isfinite(masked), allowed)
    np.testing.assert_array_equal(masked[allowed], logits[allowed])
    assert (
        _draw(logits, 1, mask=mask, temperature=0.0)[0] == np.flatnonzero(allowed)[np.argmax(logits[allowed])]
    )
    tokens = _draw(logits, 300, mask=mask, temperature=2.0)
    assert set(tokens) <= set(np.flatnonzero(allowed)) and len(set(tokens)) > min(3, allowed.sum() - 1)


@pytest.mark.parametrize("case", ["greedy", "greedy_masked", "penalised"])
def test_greedy_verification_is_the_argmax_of_the_adjusted_logits_in_every_branch(case):
    """verify_drafts picks one of three branches (plain greedy, greedy under a grammar, the general
    one); each must give the argmax of the logits after the penalty and the first position's mask."""
    rng = np.random.default_rng(7)
    n, t, vocab = 3, 3, 301
    logits = rng.normal(size=(n, t, vocab)).astype(np.float32)
    drafts = np.array([[int(np.argmax(logits[0, 0])), 5], [-1, -1], [9, -1]], np.int32)  # row 0: one hit
    allowed = np.ones((n, vocab), bool)
    if case == "greedy_masked":
        allowed[1] = rng.random(vocab) < 0.1  # row 1 is constrained (and drafts nothing)
        allowed[1, rng.integers(vocab)] = True
    counts = np.zeros((n, vocab), np.int32)
    s = _settings(n, temperature=0.0)
    if case == "penalised":
        counts[2, rng.integers(vocab, size=40)] = 1
        s = dataclasses.replace(s, presence_penalty=jnp.array([0.0, 0.0, 3.0]))
    tokens, accepted = jax.jit(verify_drafts)(
        jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(counts), s, jnp.zeros(n, jnp.int32),
        jnp.asarray(_mask_of(allowed)),
    )  # fmt: skip
    for row in range(n):
        adjusted = logits[row].copy()
        if case == "penalised":  # drafts before a position count as seen too
            seen = counts[row].astype(bool)
            for j in range(t):
                adjusted[j] -= np.where(seen, float(s.presence_penalty[row]), 0.0)
                if j < t - 1 and drafts[row, j] >= 0:
                    seen[drafts[row, j]] = True
        adjusted[0] = np.where(allowed[row], adjusted[0], -np.inf)
        want_accepted = 0
        while want_accepted < t - 1 and drafts[row, want_accepted] == np.argmax(adjusted[want_accepted]):
            want_accepted += 1
        assert int(accepted[row]) == want_accepted
        assert int(tokens[row, want_accepted]) == np.argmax(adjusted[want_accepted])


def test_token_logprobs_are_the_log_softmax_and_its_top_k(logits):
    rows = jnp.asarray(np.stack([logits, logits[::-1]]))
    token = jnp.array([5, 11], jnp.int32)
    chosen, top_vals, top_ids = token_logprobs(rows, token, _settings(2, num_logprobs=3), 4)
    want = jax.nn.log_softmax(rows.astype(jnp.float64) if jax.config.x64_enabled else rows, axis=-1)
    np.testing.assert_allclose(chosen, [want[0, 5], want[1, 11]], rtol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-np.asarray(want), axis=-1)[:, :4])
    np.testing.assert_allclose(top_vals, -np.sort(-np.asarray(want), axis=-1)[:, :4], rtol=1e-5)
    off = token_logprobs(rows, token, _settings(2), 4)  # no row asked: nothing computed
    assert not np.any(np.asarray(off[0]))


def test_per_slot_settings_do_not_leak_between_slots(logits):
    rows = jnp.asarray(np.stack([logits, logits]))
    s = _settings(2)
    s = dataclasses.replace(s, temperature=jnp.array([0.0, 5.0]), top_k=jnp.array([0, 2], jnp.int32))
    top2 = set(np.argsort(logits)[-2:])
    for seed in range(20):
        s = dataclasses.replace(s, seed=jnp.array([[0, seed], [0, seed]], jnp.uint32))
        counts = jnp.zeros((2, VOCAB), jnp.int32)
        tokens = np.asarray(sample(rows, counts, s, jnp.zeros(2, jnp.int32), _allow_all(2, VOCAB)))
        assert tokens[0] == np.argmax(logits) and tokens[1] in top2


def test_noise_is_uniform_and_uncorrelated_across_counters_keys_and_streams():
    from jaxinfer import sampling
    from jaxinfer.sampling import _slot_key, _uniform

    # Consecutive steps of one seed, and one step of consecutive seeds: the keys least apart.
    steps = jnp.arange(64, dtype=jnp.int32)
    seeds = jnp.stack([jnp.zeros(64, jnp.uint32), jnp.arange(64, dtype=jnp.uint32)], axis=1)
    keys = jnp.concatenate(
        [jax.vmap(_slot_key)(jnp.zeros((64, 2), jnp.uint32), steps), jax.vmap(_slot_key)(seeds, steps * 0)]
    )
    u = np.asarray(_uniform(keys, 4096), np.float64)  # [128 keys, 4096 counters]
    assert 0 < u.min() and u.max() < 1
    n = u.size
    # Mean and variance of U(0, 1) within ~5 standard errors; every decile holds a tenth.
    assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 5 * np.sqrt(1 / 180 / n)
    deciles = np.bincount((u * 10).astype(int).ravel(), minlength=10)
    assert stats.chisquare(deciles).pvalue > 1e-3

    def correlation(a, b):
        return np.corrcoef(a.ravel(), b.ravel())[0, 1]

    bound = 5 / np.sqrt(n // 2)
    assert abs(correlation(u[:, :-1], u[:, 1:])) < bound  # neighbouring counters
    assert abs(correlation(u[:-1], u[1:])) < bound  # neighbouring keys: steps and seeds
    other = np.asarray(_uniform(keys, 4096, stream=1), np.float64)
    assert abs(correlation(u, other)) < bound  # the acceptance stream against the Gumbel noise

    # The extreme words stay inside (0, 1), so the Gumbel noise -log(-log(u)) is finite.
    for word in (0, 0xFFFFFFFF):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                sampling,
                "_noise_bits",
                lambda keys, width, stream=0, word=word: jnp.full((1, 1), word, jnp.uint32),
            )
            extreme = float(_uniform(keys[:1], 1)[0, 0])
        assert 0 < extreme < 1 and np.isfinite(np.log(-np.log(extreme))), word


def test_seed_split_round_trips_64_bits():
    seed = (123 << 32) | 456
    assert split_seed(seed) == (123, 456)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("temperature", -0.1, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("top_p", 1.5, "top_p"),
        ("top_k", -1, "top_k"),
        ("min_p", 2.0, "min_p"),
        ("max_tokens", 0, "max_tokens"),
        ("repetition_penalty", 0.0, "repetition_penalty"),
        ("seed", -1, "seed"),
        ("frequency_penalty", 2.5, "frequency_penalty"),
        ("logprobs", 21, "logprobs"),
    ],
)
def test_invalid_sampling_values_are_rejected(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value}).validate()


def test_candidate_and_whole_vocabulary_paths_past_the_candidate_count():
    # 600 tokens > CANDIDATES: top-k draws its noise among the candidates only, min-p alone samples the
    # whole vocabulary; both must follow the filtered softmax.
    logits = np.random.default_rng(1).normal(size=600).astype(np.float32) * 2.5
    probs = np.exp(logits - logits.max())
    top = np.argsort(-logits)[:20]
    tokens = _draw(logits, 4000, top_k=20)
    assert set(tokens) <= set(top)
    expected = probs[top] / probs[top].sum()
    freq = np.array([(tokens == t).mean() for t in top])
    assert 0.5 * np.abs(freq - expected).sum() < 0.06

    allowed = np.flatnonzero(probs >= 0.01)
    tokens = _draw(logits, 4000, min_p=0.01)
    assert set(tokens) <= set(allowed)
    expected = probs[allowed] / probs[allowed].sum()
    freq = np.array([(tokens == t).mean() for t in allowed])
    assert 0.5 * np.abs(freq - expected).sum() < 0.06, len(allowed)

    # With no filter the tail past the CANDIDATES most likely tokens keeps its mass.
    tail = np.argsort(-logits)[256:]
    tail_mass = probs[tail].sum() / probs.sum()
    assert tail_mass > 0.01
    tokens = _draw(logits, 4000)
    assert abs(np.isin(tokens, tail).mean() - tail_mass) < 0.007, tail_mass


# Blocks of 8 (1000 = 8 x 125: too small, plain two passes), 1024 (Gemma's 262k), 256 (Llama 3's 128256).
@pytest.mark.parametrize("shape", [(3, 1000), (9, 1 << 18), (5, 128256)])
def test_greedy_tokens_is_the_first_argmax(shape):
    logits = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    logits[0, [5, 17]] = 50.0  # a tie inside one block: the first index wins, as in np.argmax
    logits[1, [shape[1] // 3, shape[1] // 2]] = 50.0  # a tie across blocks
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(logits)), np.argmax(logits, axis=-1))
