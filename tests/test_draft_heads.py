"""Draft heads (speculation/draft_heads.py) and their training (speculation/training.py) on a tiny random
model: training learns a deterministic pattern, propose matches the teacher-forced unroll, checkpoints
round-trip, batched hidden states equal single-sequence ones, output rows match the output layer."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.models.params import random_params
from jaxinfer.models.transformer import forward_hidden, output_logits
from jaxinfer.quantization import quantize_params
from jaxinfer.sharding import make_mesh
from jaxinfer.speculation.config import (
    AUTO,
    DEFAULT_DRAFT_MIN_PROBABILITY,
    SpeculationConfig,
    depth_threshold,
    draft_thresholds,
    min_probabilities,
)
from jaxinfer.speculation.draft_heads import (
    init_heads,
    load_heads,
    propose,
    save_heads,
    token_features,
    unroll_logits,
)
from jaxinfer.speculation.thresholds import num_drafts
from jaxinfer.speculation.training import (
    TEACHER_TOP_K,
    draft_indexer,
    draft_vocabulary,
    hidden_states,
    output_rows,
    split_sequences,
    teacher_top_k,
    train_heads,
    training_examples,
)
from jaxinfer.testing import paged_cache_config
from jaxinfer.weight_formats import Int8Weight

TINY = ModelConfig(
    arch="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
)  # fmt: skip
UNTIED = dataclasses.replace(TINY, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def params():
    return random_params(TINY, seed=1)


def _pattern_corpus(count: int, seed: int) -> tuple[list[list[int]], list[int], np.ndarray]:
    """Sequences of a random 4-token "prompt", then a response where each token is f(previous), f a fixed
    permutation of 24 tokens (so depth-0 drafts are predictable from the input token alone)."""
    rng = np.random.default_rng(seed)
    alphabet = rng.permutation(TINY.vocab_size)[:24]
    f = dict(zip(alphabet, rng.permutation(alphabet)))
    sequences, first = [], []
    for _ in range(count):
        prompt = list(rng.integers(0, TINY.vocab_size, size=4))
        x = [int(rng.choice(alphabet))]
        for _ in range(int(rng.integers(20, 40))):
            x.append(int(f[x[-1]]))
        sequences.append([int(t) for t in prompt] + x)
        first.append(4)
    return sequences, first, alphabet


def _text_labels(sequences: list[list[int]]) -> list[np.ndarray]:
    """Labels that make each sequence the target's greedy text: its own next tokens."""
    return [np.append(np.asarray(seq[1:], np.int32), -1) for seq in sequences]


def test_training_learns_a_deterministic_pattern(params):
    sequences, first, alphabet = _pattern_corpus(60, seed=0)
    heads, metrics = train_heads(
        params, TINY, sequences, first, depth=2, draft_vocab=32, steps=250, batch_size=64,
        learning_rate=1e-2, seed=0, holdout_fraction=0.2, labels=_text_labels(sequences),
    )  # fmt: skip
    hold = metrics["holdout"]
    assert metrics["examples"]["holdout"] > 50 and hold["examples"] == metrics["examples"]["holdout"]
    # The draft vocabulary starts with the pattern's 24 tokens; every target is inside it.
    assert set(np.asarray(heads.vocab[:24]).tolist()) == set(alphabet.tolist())
    assert hold["in_draft_vocab"] == 1.0
    chance = 1 / 24
    assert hold["accuracy"][0] > 0.8 > 10 * chance, hold
    assert metrics["loss_end"] < 0.2 * metrics["loss_start"]
    assert metrics["best_step"] % 25 == 0 and metrics["best_step"] > 0  # a checkpoint every tenth
    # The same split untrained: the accuracy is training's.
    _, untrained = train_heads(
        params, TINY, sequences, first, depth=2, draft_vocab=32, steps=0, seed=0, holdout_fraction=0.2,
        labels=_text_labels(sequences),
    )  # fmt: skip
    assert untrained["examples"] == metrics["examples"] and untrained["holdout"]["accuracy"][0] < 0.3
    # Accepted drafts per step: sum over depths of the chain product, so between acc[0] and the sum.
    assert hold["accuracy"][0] - 1e-6 <= hold["accepted_per_step"] <= sum(hold["accuracy"]) + 1e-6
    sure = hold["sure"]
    assert sure["min_probability"] == list(DEFAULT_DRAFT_MIN_PROBABILITY)
    assert 0 < sure["accepted_per_step"] <= sure["drafts_per_step"] <= 2
    assert sure["accepted_per_step"] <= hold["accepted_per_step"] + 1e-6
    # The held-out drafts kept for choosing thresholds: every held-out position here (fewer than the
    # sample's limit), with the chains and sure drafts that evaluate counts.
    drafts = metrics["held_out_drafts"]
    assert drafts.probability.shape == (hold["examples"], 2)
    assert np.all((drafts.probability > 1 / 32) & (drafts.probability <= 1))
    assert abs(np.mean(drafts.accepted) - hold["accepted_per_step"]) < 1e-4
    cut = num_drafts(drafts, sure["min_probability"])
    assert abs(np.mean(cut) - sure["drafts_per_step"]) < 1e-4
    assert abs(np.mean(np.minimum(cut, drafts.accepted)) - sure["accepted_per_step"]) < 1e-4


def test_training_learns_the_greedy_choices_of_sampled_text(params):
    """Sampled answers: a third of the text's tokens are noise, not the pattern the "target" would
    choose greedily. The heads learn the greedy labels, and the held-out chain counts a right draft at
    depth 1 only where the text followed the path the first draft took."""
    sequences, first, alphabet = _pattern_corpus(80, seed=3)
    rng = np.random.default_rng(4)
    f = {int(a): int(b) for s in sequences for a, b in zip(s[4:], s[5:])}  # the pattern, from clean text
    noisy, labels = [], []
    for seq in sequences:
        x = list(seq[:5])
        for _ in seq[5:]:  # each next token: the pattern's choice, or a random alphabet token
            x.append(f[x[-1]] if rng.random() > 0.35 else int(rng.choice(alphabet)))
        noisy.append(x)
        labels.append(np.asarray([f.get(t, -1) for t in x], np.int32))
    _, metrics = train_heads(
        params, TINY, noisy, first, depth=2, draft_vocab=32, steps=250, batch_size=64, learning_rate=1e-2,
        seed=0, holdout_fraction=0.2, labels=labels,
    )  # fmt: skip
    hold = metrics["holdout"]
    assert min(hold["accuracy"]) > 0.8, hold  # against the noisy text itself it could reach ~0.67
    # Without the cut the chain would be near acc[0] + acc[1]; the text stays on the path ~2/3 of the time.
    assert hold["accuracy"][0] + 0.4 * hold["accuracy"][1] < hold["accepted_per_step"]
    assert hold["accepted_per_step"] < hold["accuracy"][0] + 0.8 * hold["accuracy"][1]


def test_distillation_learns_the_targets_distribution(params):
    """Each token is followed by f(x) with probability 0.7 and g(x) with 0.3. The greedy labels alone
    teach the heads that f(x) always follows (probability near 1); distilled on the target's top
    choices they learn 0.7: a draft's probability under its head estimates the target's own."""
    rng = np.random.default_rng(5)
    alphabet = rng.permutation(TINY.vocab_size)[:24]
    f = dict(zip(alphabet.tolist(), rng.permutation(alphabet).tolist()))
    g = {a: f[b] for a, b in zip(alphabet.tolist(), rng.permutation(alphabet).tolist())}
    g = {a: (b if b != f[a] else f[f[a]]) for a, b in g.items()}
    sequences, labels, teacher = [], [], []
    for _ in range(80):
        x = [int(t) for t in rng.integers(0, TINY.vocab_size, size=4)] + [int(rng.choice(alphabet))]
        for _ in range(30):
            x.append(f[x[-1]] if rng.random() < 0.7 else g[x[-1]])
        ids = np.asarray([[f.get(t, -1), g.get(t, -1)] for t in x], np.int32)
        ids[:4] = -1  # the prompt's next tokens are not the pattern's
        sequences.append(x)
        labels.append(ids[:, 0].copy())
        teacher.append((ids, np.log(np.broadcast_to([0.7, 0.3], ids.shape)).astype(np.float32)))
    first = [4] * len(sequences)
    hidden, _, _ = hidden_states(params, TINY, sequences)
    common = dict(depth=1, draft_vocab=32, steps=250, batch_size=64, learning_rate=1e-2, seed=0,
                  holdout_fraction=0.2, hidden=hidden, labels=labels, teacher=teacher)  # fmt: skip
    probability = {}
    for weight in (0.0, 1.0):
        heads, metrics = train_heads(params, TINY, sequences, first, soft_weight=weight, **common)
        assert metrics["holdout"]["accuracy"][0] > 0.9  # the greedy choice either way
        ex = training_examples(
            sequences[-16:], hidden[-16:], labels[-16:], first[-16:], 1, np.asarray(heads.vocab)
        )
        logits = unroll_logits(
            heads, jnp.asarray(ex.hidden), token_features(params, TINY, jnp.asarray(ex.inputs))
        )
        probability[weight] = float(np.mean(np.asarray(jax.nn.softmax(logits, axis=-1)).max(axis=-1)))
    assert probability[0.0] > 0.9, probability
    assert 0.6 < probability[1.0] < 0.8, probability


def test_draft_indexer_finds_each_token_or_minus_one():
    vocab = np.asarray([40, 7, 93, 12, 0], np.int32)
    tokens = np.asarray([[93, 5, 0], [12, 41, 7]], np.int32)
    want = [[list(vocab).index(t) if t in vocab else -1 for t in row] for row in tokens.tolist()]
    assert draft_indexer(vocab)(tokens).tolist() == want


def test_soft_weight_outside_zero_to_one_is_refused(params):
    assert teacher_top_k(0.0) == 1 and teacher_top_k(0.5) == teacher_top_k(1.0) == TEACHER_TOP_K
    for weight in (-0.1, 1.5):
        with pytest.raises(ValueError, match="soft_weight"):
            train_heads(params, TINY, [[1, 2, 3, 4]], [2], soft_weight=weight)


def test_split_holds_out_whole_groups():
    """Several answers to one prompt are one group: all of them train or all are held out."""
    groups = np.repeat(np.arange(20), 3)  # 20 prompts, 3 answers each
    train, hold = split_sequences(len(groups), 0.2, seed=4, groups=groups)
    assert sorted(np.concatenate([train, hold]).tolist()) == list(range(60))
    assert len(hold) == 12 and not set(groups[train]) & set(groups[hold])
    plain_train, plain_hold = split_sequences(60, 0.2, seed=4)
    assert len(plain_hold) == 12 and not set(plain_train) & set(plain_hold)


def test_draft_vocabulary_orders_by_frequency():
    vocab = draft_vocabulary([[5, 5, 3, 9, -1], [3, 5, 9, 9, 9]], vocab_size=12, size=5)
    assert vocab.dtype == np.int32
    assert vocab.tolist() == [9, 5, 3, 0, 1]  # 9 x4, 5 x3, 3 x2, then unseen ids by id; -1 is no token


def test_training_examples_windows_and_mask():
    seq = [10, 11, 12, 13, 14, 15, 16]  # response from index 3 on
    hidden = [np.arange(7, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)]
    vocab = np.asarray([14, 13, 16], np.int32)  # 15 is outside the draft vocabulary
    ex = training_examples([seq], hidden, _text_labels([seq]), [3], depth=2, vocab=vocab)
    # t from 2 (first - 1) while t + 3 < 7: t = 2, 3
    assert ex.hidden[:, 0].tolist() == [2.0, 3.0]
    assert ex.inputs.tolist() == [[13, 14], [14, 15]]
    assert ex.targets.tolist() == [[0, -1], [-1, 2]]  # 14 -> 0, 15 -> -1, 16 -> 2
    assert ex.on_path.all()  # the text is its own greedy path
    # Greedy labels: the target would have said 16 after 13 and 13 after 15; its choice after 14 is 15.
    greedy = np.asarray([0, 0, 0, 16, 15, 13, 0], np.int32)
    ex = training_examples([seq], hidden, [greedy], [3], depth=2, vocab=vocab)
    assert ex.inputs.tolist() == [[13, 14], [14, 15]]  # the text's tokens are still the inputs
    assert ex.targets.tolist() == [[2, -1], [-1, 1]]  # g[3] = 16, g[4] = 15, g[5] = 13
    # Depth 1's input x[t+2] against the greedy choice g[t+1]: 14 != 16 (t = 2), 15 == 15 (t = 3).
    assert ex.on_path.tolist() == [[True, False], [True, True]]
    # The target's top two choices after each position, as soft targets of the same drafts.
    ids = np.stack([greedy, np.roll(greedy, 1)], axis=1)
    logprobs = np.log(np.broadcast_to([0.6, 0.25], ids.shape))
    ex = training_examples([seq], hidden, [greedy], [3], depth=2, vocab=vocab, teacher=[(ids, logprobs)])
    # Positions 3, 4 (t = 2) and 4, 5 (t = 3): ids[3] = (16, 0), ids[4] = (15, 16), ids[5] = (13, 15).
    assert ex.soft_targets.tolist() == [[[2, -1], [-1, 2]], [[-1, 2], [1, -1]]]
    np.testing.assert_allclose(ex.soft_probs, np.broadcast_to([0.6, 0.25], (2, 2, 2)), rtol=1e-6)
    assert training_examples([seq], hidden, [greedy], [3], depth=2, vocab=vocab).soft_targets is None


def test_propose_agrees_with_unroll_logits(params):
    vocab = jnp.asarray(np.random.default_rng(2).permutation(TINY.vocab_size)[:40], jnp.int32)
    heads = init_heads(jax.random.key(3), TINY.hidden_size, 3, vocab, output_rows(params, TINY, vocab))
    # Large random block weights so each depth's drafts differ from a plain copy of the state's guess.
    heads = dataclasses.replace(heads, w=jax.random.normal(jax.random.key(4), heads.w.shape) * 0.3)
    rows = 16
    hidden = jax.random.normal(jax.random.key(5), (rows, TINY.hidden_size))
    token = jnp.asarray(np.random.default_rng(6).integers(0, TINY.vocab_size, rows), jnp.int32)
    drafts = propose(heads, params, TINY, hidden, token, 3)
    assert drafts.shape == (rows, 3) and drafts.dtype == jnp.int32
    assert len(np.unique(np.asarray(drafts))) > 3  # not one constant draft
    teacher = jnp.concatenate([token[:, None], drafts[:, :-1]], axis=1)  # inputs x[t+1 .. t+depth]
    logits = unroll_logits(heads, hidden, token_features(params, TINY, teacher))
    np.testing.assert_array_equal(np.asarray(heads.vocab[jnp.argmax(logits, -1)]), np.asarray(drafts))


def test_propose_drafts_only_while_its_heads_are_sure(params):
    """With min_probability, a row's drafts are the unthresholded drafts up to the first one whose
    probability under its head is below it, then -1: the threshold cuts each row's chain at its own
    depth."""
    vocab = jnp.asarray(np.random.default_rng(7).permutation(TINY.vocab_size)[:40], jnp.int32)
    heads = init_heads(jax.random.key(8), TINY.hidden_size, 3, vocab, output_rows(params, TINY, vocab))
    heads = dataclasses.replace(heads, w=jax.random.normal(jax.random.key(9), heads.w.shape) * 0.3,
                                out=heads.out * 6.0)  # fmt: skip
    rows = 64
    hidden = jax.random.normal(jax.random.key(10), (rows, TINY.hidden_size))
    token = jnp.asarray(np.random.default_rng(11).integers(0, TINY.vocab_size, rows), jnp.int32)
    every = np.asarray(propose(heads, params, TINY, hidden, token, 3))
    teacher = jnp.concatenate([token[:, None], jnp.asarray(every[:, :-1])], axis=1)
    p = np.asarray(jax.nn.softmax(unroll_logits(heads, hidden, token_features(params, TINY, teacher)), -1))
    top = p.max(axis=-1)  # [rows, 3]: each draft's probability under its head
    threshold = float(np.median(top))
    sure = np.asarray(propose(heads, params, TINY, hidden, token, 3, min_probability=threshold))
    kept = np.cumprod(top >= threshold, axis=1).astype(bool)
    np.testing.assert_array_equal(sure, np.where(kept, every, -1))
    depths = kept.sum(axis=1)
    assert {0, 3} <= set(depths.tolist()) and len(set(depths.tolist())) >= 3  # rows stop at their own depth

    # Rows that do not draft get -1 and leave the others' drafts as they were.
    drafting = np.random.default_rng(12).random(rows) < 0.5
    masked = propose(heads, params, TINY, hidden, token, 3, min_probability=threshold,
                     drafting=jnp.asarray(drafting))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(masked), np.where(drafting[:, None], sure, -1))
    # One drafting row of each depth: the heads after the one it doubts are skipped, its drafts stand.
    for depth in sorted(set(depths.tolist())):
        row = int(np.flatnonzero(depths == depth)[0])
        alone = propose(heads, params, TINY, hidden, token, 3, min_probability=threshold,
                        drafting=jnp.arange(rows) == row)  # fmt: skip
        want = np.full((rows, 3), -1)
        want[row] = sure[row]
        np.testing.assert_array_equal(np.asarray(alone), want)

    # A threshold per depth (the last holds past the list): the chain stops at the first draft below
    # its own depth's threshold.
    low, high = float(np.quantile(top, 0.25)), float(np.quantile(top, 0.75))
    per_depth = np.asarray(propose(heads, params, TINY, hidden, token, 3, min_probability=(low, high)))
    kept = np.cumprod(top >= np.array([low, high, high]), axis=1).astype(bool)
    np.testing.assert_array_equal(per_depth, np.where(kept, every, -1))
    # The same thresholds as an array, as the engine's programs take them (an argument, not a constant).
    as_array = propose(heads, params, TINY, hidden, token, 3, min_probability=jnp.asarray([low, high, high]))
    np.testing.assert_array_equal(np.asarray(as_array), per_depth)
    assert len(set(kept.sum(axis=1).tolist())) >= 3


def test_min_probabilities_per_depth():
    assert min_probabilities(0.5) == (0.5,)
    assert min_probabilities("0.25,0.65") == (0.25, 0.65)
    assert min_probabilities([0, 0.9]) == (0.0, 0.9)
    assert [depth_threshold((0.25, 0.65), d) for d in range(4)] == [0.25, 0.65, 0.65, 0.65]
    assert SpeculationConfig(draft_min_probability=0.3).draft_min_probability == (0.3,)
    assert SpeculationConfig().draft_min_probability == DEFAULT_DRAFT_MIN_PROBABILITY
    assert SpeculationConfig(draft_min_probability="auto").draft_min_probability == AUTO  # chosen at warm-up
    assert draft_thresholds("auto") == AUTO and draft_thresholds("0.2,0.5") == (0.2, 0.5)
    with pytest.raises(ValueError):
        draft_thresholds("automatic")
    for bad in (1.0, "0.2,-0.1", (), "x"):
        with pytest.raises(ValueError):
            min_probabilities(bad)


def test_save_and_load_round_trip(tmp_path, params):
    vocab = jnp.arange(10, 30, dtype=jnp.int32)
    heads = init_heads(jax.random.key(0), TINY.hidden_size, 2, vocab, output_rows(params, TINY, vocab))
    heads = dataclasses.replace(heads, b=jax.random.normal(jax.random.key(1), heads.b.shape))
    save_heads(tmp_path / "heads", heads, {"model": "tiny", "vocab_size": TINY.vocab_size, "examples": 7})
    loaded, info = load_heads(tmp_path / "heads", TINY)
    for name in ("w", "b", "norm", "out", "vocab"):
        a, b = getattr(heads, name), getattr(loaded, name)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert info["examples"] == 7 and info["depth"] == 2 and info["draft_vocab"] == 20
    with pytest.raises(ValueError, match="hidden size"):
        load_heads(tmp_path / "heads", dataclasses.replace(TINY, hidden_size=128))
    with pytest.raises(ValueError):
        load_heads(tmp_path / "heads", dataclasses.replace(TINY, vocab_size=98))
    with pytest.raises(ValueError, match="no draft heads"):
        load_heads(tmp_path / "elsewhere", TINY)


_forward_hidden = jax.jit(forward_hidden, static_argnames=("config",))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_hidden_states_batched_equal_single(params, cache_dtype):
    rng = np.random.default_rng(7)
    lengths = [5, 64, 65, 17, 1, 150, 70]  # three length buckets, partly filled batches
    sequences = [list(rng.integers(0, TINY.vocab_size, n)) for n in lengths]
    got, choices, logprobs = hidden_states(
        params, TINY, sequences, cache_dtype=cache_dtype, tokens_per_batch=256, top_k=5
    )
    assert [g.shape for g in got] == [(n, TINY.hidden_size) for n in lengths]
    assert [c.shape for c in choices] == [(n, 5) for n in lengths] == [lp.shape for lp in logprobs]
    # The reference: each sequence alone in a row of its own, followed by a tail of zero tokens at real
    # positions (causal attention: nothing after a position changes it), one compiled shape.
    width, undecided = 160, 0
    cache = init_cache(TINY, paged_cache_config(1, width, page_size=16, dtype=cache_dtype), make_mesh())
    for seq, g, top, lp in zip(sequences, got, choices, logprobs):
        tokens = jnp.zeros((1, width), jnp.int32).at[0, : len(seq)].set(jnp.asarray(seq, jnp.int32))
        x, cache = _forward_hidden(
            params, TINY, tokens, jnp.arange(width, dtype=jnp.int32)[None], cache,
            jnp.asarray(contiguous_page_table(1, width // 16)),
        )  # fmt: skip
        assert g.dtype == np.float32
        # A bfloat16 cache rounds K/V: a last-bit difference of the batched products can flip a rounding.
        tol = 1e-5 if cache_dtype == "float32" else 1e-3
        np.testing.assert_allclose(g, np.asarray(x[0, : len(seq)], np.float32), atol=tol, rtol=tol)
        logits = np.asarray(output_logits(params, TINY, x[0, : len(seq)]))
        assert top.dtype == np.int32 and lp.dtype == np.float32
        # The greedy token (column 0) at each position, up to near ties of the two runs' last bits.
        top2 = np.sort(logits, axis=-1)[:, -2:]
        greedy_decided = top2[:, 1] - top2[:, 0] > 1e-3
        assert greedy_decided.mean() > 0.9
        np.testing.assert_array_equal(top[greedy_decided, 0], logits.argmax(-1)[greedy_decided])
        # The top 5 tokens at each position, best first, up to near ties of the two runs' last bits.
        ranked = np.argsort(-logits, axis=-1, kind="stable")[:, :6]
        gaps = -np.diff(np.take_along_axis(logits, ranked, axis=-1), axis=-1)  # [len, 5]
        decided = gaps.min(axis=-1) > 1e-3
        undecided += int(np.sum(~decided))
        np.testing.assert_array_equal(top[decided], ranked[decided, :5])
        reference = logits - np.log(np.sum(np.exp(logits), axis=-1, keepdims=True))
        np.testing.assert_allclose(lp, np.take_along_axis(reference, top, axis=-1), atol=tol, rtol=tol)
    assert undecided < 0.3 * sum(lengths)


def test_output_rows_float_and_int8():
    ids = np.asarray([3, 0, 96, 41], np.int32)
    for config in (TINY, UNTIED):
        params = random_params(config, seed=2)
        head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
        expected = np.asarray(head)[ids]
        np.testing.assert_array_equal(np.asarray(output_rows(params, config, ids)), expected)
        quantized = quantize_params(random_params(config, seed=2), "int8")
        q_head = quantized["embed"] if config.tie_word_embeddings else quantized["lm_head"]
        assert isinstance(q_head, Int8Weight)
        rows = np.asarray(output_rows(quantized, config, ids))
        assert rows.shape == expected.shape and rows.dtype == np.float32
        half_step = np.asarray(q_head.scale)[ids][:, None] / 2
        assert np.all(np.abs(rows - expected) <= half_step * 1.001 + 1e-7)
        assert not np.array_equal(rows, expected)  # really the quantised values
