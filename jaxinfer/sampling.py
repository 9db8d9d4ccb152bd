"""Token sampling on device, per slot: penalties, a grammar's token mask, greedy, temperature, top-k,
top-p, min-p, seeded; and the log-probabilities a request asks for.

Every slot carries its own settings as arrays, so one compiled step serves any mix of requests.
Randomness: token i of a request uses key fold_in(fold_in(fold_in(key(0), seed_hi), seed_lo), i), so a
seeded request gives the same tokens whatever else is batched with it. The key is expanded into noise
words by a hash of (key, counter) (_noise_bits) rather than by threefry: XLA:CPU compiles threefry over
a vector slowly (~0.3 s a draw, most of the sampled branch), and the noise needs no more than a
well-mixed counter stream.

Filters are exact for top_k <= CANDIDATES. The top-p nucleus is searched among the CANDIDATES most likely
tokens: when those hold less than top_p of the mass the nucleus stops there (a vocabulary tail past the
CANDIDATES-th token is never that likely in practice, and a full-vocabulary sort per step costs more
than the rest of the step on CPU).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxinfer.structured_output import ALLOW_ALL

CANDIDATES = 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotSampling:
    """Sampling settings of every slot; all arrays are [slots]."""

    temperature: jax.Array  # float32, 0 = greedy
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    min_p: jax.Array  # float32, 0 = off
    repetition_penalty: jax.Array  # float32, 1 = off
    presence_penalty: jax.Array  # float32, 0 = off
    frequency_penalty: jax.Array  # float32, 0 = off
    num_logprobs: jax.Array  # int32: alternatives to return, -1 = no log-probabilities
    seed: jax.Array  # uint32 [slots, 2]: (high, low) words of the 64-bit seed


def apply_penalties(logits: jax.Array, counts: jax.Array, s: SlotSampling) -> jax.Array:
    """logits: [slots, vocab] float32; counts: [slots, vocab] int32, occurrences of each token in the
    prompt and the output so far. Skipped when no slot has a penalty (the common case), so the counts
    are not read."""

    def penalise() -> jax.Array:
        seen = counts > 0
        rp = s.repetition_penalty[:, None]
        penalised = jnp.where(logits > 0, logits / rp, logits * rp)
        out = jnp.where(seen, penalised, logits) - jnp.where(seen, s.presence_penalty[:, None], 0.0)
        return out - s.frequency_penalty[:, None] * counts.astype(jnp.float32)

    return jax.lax.cond(jnp.any(_has_penalty(s)), penalise, lambda: logits)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits: [slots, vocab]; mask: [slots, ceil(vocab / 32)] int32, bit i of word w allows token
    32 * w + i. Rows whose mask allows everything are unchanged, and when every row does (no request
    is constrained) the unpacking is skipped."""
    return jax.lax.cond(jnp.all(mask == ALLOW_ALL), lambda: logits, lambda: _masked(logits, mask))


def _masked(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """apply_token_mask without the branch: -inf wherever the mask's bit is clear."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (mask[:, :, None] >> shifts) & 1  # [slots, words, 32]
    allowed = bits.reshape(mask.shape[0], -1)[:, : logits.shape[-1]] == 1
    return jnp.where(allowed, logits, -jnp.inf)


def token_logprobs(
    logits: jax.Array, token: jax.Array, s: SlotSampling, k: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities under the model's own distribution (before penalties, masks and temperature,
    as vLLM and OpenAI report them): the chosen token's [slots], and the k most likely tokens'
    ([slots, k] values and ids). Computed only when some row asks for them; zeros otherwise."""
    k = min(k, logits.shape[-1])

    def compute():
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
        top_vals, top_ids = jax.lax.top_k(logp, k)
        return chosen, top_vals, top_ids.astype(jnp.int32)

    def skip():
        n = logits.shape[0]
        return jnp.zeros(n, jnp.float32), jnp.zeros((n, k), jnp.float32), jnp.zeros((n, k), jnp.int32)

    return jax.lax.cond(jnp.any(s.num_logprobs >= 0), compute, skip)


def _slot_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    """The key of one token of one request: uint32 [2]."""
    key = jax.random.fold_in(jax.random.key(0), seed[0])
    key = jax.random.fold_in(key, seed[1])
    return jax.random.key_data(jax.random.fold_in(key, step))


_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive counters over the words


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection of uint32 in which every input bit flips each output
    bit with probability ~1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _noise_bits(keys: jax.Array, width: int, stream: int = 0) -> jax.Array:
    """uint32 [n, width]: word i of each key's (keys: uint32 [n, 2]) stream `stream`. Distinct
    counters give distinct words (two bijections of the counter), and each key word is mixed in
    through a full avalanche."""
    counter = jnp.arange(width, dtype=jnp.uint32)[None] * jnp.uint32(_GOLDEN)
    first = _fmix32(counter ^ keys[:, :1])
    return _fmix32(first ^ (keys[:, 1:] + jnp.uint32((stream * _GOLDEN) & 0xFFFFFFFF)))


def _uniform(keys: jax.Array, width: int, stream: int = 0) -> jax.Array:
    """float32 [n, width] in (0, 1): the top 23 bits of each noise word, centred in their interval.
    Not 24: the top value 1 - 2^-25 would round to 1.0 in float32, and -log(-log(1)) is infinite."""
    bits = (_noise_bits(keys, width, stream) >> 9).astype(jnp.float32)
    return (bits + 0.5) * (1.0 / (1 << 23))


def _filter(logits: jax.Array, s: SlotSampling) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Temperature, then the top-k / top-p / min-p threshold: the filtered distribution of each slot is
    softmax(scaled) over the tokens with scaled >= threshold.

    Returns scaled [slots, vocab], threshold [slots, 1], and the CANDIDATES most likely tokens' scaled
    logits and ids [slots, c] (descending).
    """
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temp  # [slots, vocab]
    top_vals, top_ids = jax.lax.top_k(scaled, min(CANDIDATES, scaled.shape[-1]))  # [slots, c], descending
    num_cand = top_vals.shape[-1]

    k = jnp.clip(s.top_k, 1, num_cand)
    kth = jnp.take_along_axis(top_vals, (k - 1)[:, None], axis=-1)[:, 0]
    thr_k = jnp.where(s.top_k > 0, kth, -jnp.inf)

    log_z = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    cand_probs = jnp.exp(top_vals - log_z)
    mass_before = jnp.cumsum(cand_probs, axis=-1) - cand_probs
    in_nucleus = mass_before < s.top_p[:, None]  # the first candidate is always in
    last_in = jnp.sum(in_nucleus, axis=-1) - 1
    nucleus_min = jnp.take_along_axis(top_vals, last_in[:, None], axis=-1)[:, 0]
    thr_p = jnp.where(s.top_p < 1.0, nucleus_min, -jnp.inf)

    # The max of `scaled`, not top_vals[:, 0]: a static slice of top_k's output makes XLA:CPU lower it as
    # a full sort of the vocabulary (~9 ms per row at 49k tokens) instead of its TopK kernel.
    top = jnp.max(scaled, axis=-1)
    thr_m = jnp.where(s.min_p > 0, top + jnp.log(jnp.maximum(s.min_p, 1e-30)), -jnp.inf)

    threshold = jnp.maximum(jnp.maximum(thr_k, thr_p), thr_m)[:, None]  # [slots, 1]
    return scaled, threshold, top_vals, top_ids


def _filtered_sample(
    logits: jax.Array, s: SlotSampling, keys: jax.Array, exclude: jax.Array | None = None
) -> jax.Array:
    """A draw from each slot's filtered distribution (_filter) by Gumbel-max, with the noise of
    each slot's token key (keys: uint32 [slots, 2], _slot_key).

    exclude: [slots] int32, a token each slot must not draw (-1: none), removed after the threshold
    is set: a draw from the filtered distribution with that token's mass taken out and the rest
    renormalised (the residual of rejection sampling against a one-token draft).

    A slot whose threshold keeps only tokens among the CANDIDATES most likely (any top-k or top-p
    filter) draws its noise for those CANDIDATES alone; drawing it for the whole vocabulary costs more
    than the candidates' top-k. Slots that may keep more (no filter, or min-p alone) use the whole
    vocabulary, in a branch that only runs when such a slot exists.
    """
    scaled, threshold, top_vals, top_ids = _filter(logits, s)
    num_cand = top_vals.shape[-1]
    exclude = jnp.full(logits.shape[:1], -1, jnp.int32) if exclude is None else exclude

    def gumbel(width: int) -> jax.Array:
        return -jnp.log(-jnp.log(_uniform(keys, width)))

    kept = jnp.where((top_vals >= threshold) & (top_ids != exclude[:, None]), top_vals, -jnp.inf)
    pick = jnp.argmax(kept + gumbel(num_cand), axis=-1)
    from_candidates = jnp.take_along_axis(top_ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    # May keep more than the candidates (min over top_vals, not a slice of it: see above).
    wide = (threshold[:, 0] < jnp.min(top_vals, axis=-1)) & (s.temperature > 0)

    def whole_vocabulary() -> jax.Array:
        ids = jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 1)
        masked = jnp.where((scaled >= threshold) & (ids != exclude[:, None]), scaled, -jnp.inf)
        return greedy_tokens(masked + gumbel(scaled.shape[-1]))

    from_vocabulary = jax.lax.cond(jnp.any(wide), whole_vocabulary, lambda: from_candidates)
    return jnp.where(wide, from_vocabulary, from_candidates)


def filtered_probability(logits: jax.Array, s: SlotSampling, token: jax.Array) -> jax.Array:
    """[slots] float32: the probability of `token` [slots] (-1: none, probability 0) under each slot's
    filtered distribution, the one _filtered_sample draws from."""
    scaled, threshold, _, _ = _filter(logits, s)
    log_z = jax.nn.logsumexp(jnp.where(scaled >= threshold, scaled, -jnp.inf), axis=-1)
    value = jnp.take_along_axis(scaled, jnp.maximum(token, 0)[:, None], axis=-1)[:, 0]
    kept = (token >= 0) & (value >= threshold[:, 0])
    return jnp.where(kept, jnp.exp(value - log_z), 0.0)


GREEDY_BLOCK = 1024  # vocabulary entries per block of the blockwise argmax


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """argmax over the last axis (the first index of the maximum), [slots, vocab] -> [slots] int32.

    XLA:CPU's argmax is a variadic (value, index) reduction that runs ~3-6x slower than a max followed
    by a min over the indices holding it, and both read every logit at ~2 GB/s: 9.7 ms a step for
    Gemma's 262k-token vocabulary at 16 slots. So the vocabulary is cut into blocks of up to
    GREEDY_BLOCK (a power of two that divides it): one fast max per block, then the two passes only
    over the block maxima and over the one block that holds the first maximum (a twelfth of the plain
    argmax's time at 16 x 262k).
    """
    vocab = logits.shape[-1]
    block = math.gcd(vocab, GREEDY_BLOCK)
    if block < 64:  # no useful power-of-two block divides the vocabulary
        return _first_max(logits)
    blocks = logits.reshape(*logits.shape[:-1], vocab // block, block)
    first_block = _first_max(jnp.max(blocks, axis=-1))  # [...]
    rows = jnp.take_along_axis(blocks, first_block[..., None, None], axis=-2)[..., 0, :]
    return first_block * block + _first_max(rows)


def _first_max(x: jax.Array) -> jax.Array:
    """The first index of the maximum over the last axis, in two passes (max, then min over indices)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == top, ids, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # a NaN row matches nothing: keep the id valid


def sample(
    logits: jax.Array, counts: jax.Array, s: SlotSampling, steps: jax.Array, mask: jax.Array
) -> jax.Array:
    """Picks one token per slot.

    logits: [slots, vocab] float32; counts: [slots, vocab] int32 (apply_penalties); steps: [slots]
    int32, the index of the token being sampled within its request (for the per-request random
    stream); mask: [slots, ceil(vocab / 32)] int32 (apply_token_mask). Returns [slots] int32.
    A verification with no drafts (verify_drafts): penalties, the mask, then greedy or a filtered draw;
    when every slot is greedy (the common serving case) the top-k and the noise are skipped entirely.
    """
    no_drafts = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return verify_drafts(logits[:, None], no_drafts, counts, s, steps, mask)[0][:, 0]


def split_seed(seed: int) -> tuple[int, int]:
    """A 64-bit seed as (high, low) uint32 words."""
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


def verify_drafts(
    logits: jax.Array,
    drafts: jax.Array,
    counts: jax.Array,
    s: SlotSampling,
    steps: jax.Array,
    mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Speculative verification: which drafted tokens each slot keeps, and the token after them.

    logits: [slots, T, vocab] float32, the target's logits after each of the T = k + 1 inputs (the
    last token, then the k drafts); drafts: [slots, k] int32, -1 past a slot's drafts; counts:
    [at least slots, vocab] int32 (apply_penalties; rows past `slots` are not read, and only the
    branch with penalties slices them, so a caller passes all of its state's rows uncopied); mask:
    [slots, ceil(vocab / 32)] int32 (apply_token_mask), binding the first position only (constrained
    slots draft nothing); steps: [slots], the index of the first token sampled here within its request
    (the per-request random stream).

    Position i accepts draft i when the target agrees: greedy slots when it is the argmax, sampled slots
    with probability p_i(draft) under the filtered distribution (rejection sampling against a one-token
    draft), and a rejection draws from p_i with the draft's mass removed, so every output token follows
    the target's distribution exactly. Returns tokens [slots, T] (position i: draft i if accepted, else
    the target's own draw) and the accepted count [slots]: the slot outputs tokens[:, :accepted + 1].
    Penalties see the drafts before each position as part of the output.
    """
    n, t, vocab = logits.shape
    targets = jnp.concatenate([drafts, jnp.full((n, 1), -1, jnp.int32)], axis=1)  # [n, T]

    def greedy_only(masked: bool) -> tuple[jax.Array, jax.Array]:
        flat = logits.reshape(n * t, vocab)
        if masked:  # constrained slots draft nothing: the mask binds their one position
            flat = _masked(flat, _first_position(mask, t))
        greedy = greedy_tokens(flat).reshape(n, t)
        return _accepted_run(targets, (targets >= 0) & (greedy == targets), greedy)

    # Greedy without penalties (the serving common case; structured output's usual one with the mask)
    # reads the logits once. Every branch returns a few ints per row: a branch that passed the
    # [n * T, vocab] logits through unchanged would copy them (XLA:CPU, Gemma's 262k vocabulary at 16
    # rows: ~1 ms a copy).
    greedy = ~jnp.any(_has_penalty(s)) & ~jnp.any(s.temperature > 0)
    branch = jnp.where(greedy, jnp.where(jnp.all(mask == ALLOW_ALL), 0, 1), 2)
    return jax.lax.switch(
        branch,
        [
            lambda: greedy_only(False),
            lambda: greedy_only(True),
            lambda: _verify_adjusted(logits, targets, counts, s, steps, mask),
        ],
    )


def _has_penalty(s: SlotSampling) -> jax.Array:
    return (s.repetition_penalty != 1.0) | (s.presence_penalty != 0.0) | (s.frequency_penalty != 0.0)


def _first_position(mask: jax.Array, t: int) -> jax.Array:
    """Masks [n, words] for the first of each slot's t positions, allow-all for the rest: [n * t, words]."""
    n, words = mask.shape
    return jnp.concatenate([mask[:, None], jnp.full((n, t - 1, words), ALLOW_ALL)], axis=1).reshape(n * t, -1)


def _accepted_run(targets: jax.Array, accept: jax.Array, own: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(tokens [n, T]: the accepted drafts, else the slot's own token; the accepted count [n])."""
    tokens = jnp.where(accept, targets, own).astype(jnp.int32)
    return tokens, jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)


def _verify_adjusted(logits, targets, counts, s, steps, mask) -> tuple[jax.Array, jax.Array]:
    """verify_drafts where some row has a penalty, a grammar or a temperature."""
    n, t, vocab = logits.shape
    drafts, counts = targets[:, :-1], counts[:n]

    def rows(a: jax.Array) -> jax.Array:  # per-slot values -> one per (slot, position)
        return jnp.repeat(a, t, axis=0)

    s_rows = jax.tree.map(rows, s)
    flat = logits.reshape(n * t, vocab)

    def penalised() -> jax.Array:
        earlier = jax.nn.one_hot(jnp.where(drafts >= 0, drafts, vocab), vocab, dtype=jnp.int32)  # [n, k, V]
        seen = counts[:, None] + jnp.cumsum(jnp.pad(earlier, ((0, 0), (1, 0), (0, 0))), axis=1)
        return apply_penalties(flat, seen.reshape(n * t, vocab), s_rows)

    flat = jax.lax.cond(jnp.any(_has_penalty(s)), penalised, lambda: flat)
    flat = apply_token_mask(flat, _first_position(mask, t))

    greedy = greedy_tokens(flat).reshape(n, t)
    flat_targets = targets.reshape(-1)
    flat_steps = (steps[:, None] + jnp.arange(t, dtype=steps.dtype)).reshape(-1)

    def sampled() -> tuple[jax.Array, jax.Array]:
        keys = jax.vmap(_slot_key)(s_rows.seed, flat_steps)
        if t == 1:  # nothing to verify (a plain decode step): a plain draw
            return _filtered_sample(flat, s_rows, keys).reshape(n, t), jnp.zeros((n, t), bool)
        draws = _filtered_sample(flat, s_rows, keys, exclude=flat_targets).reshape(n, t)
        p = filtered_probability(flat, s_rows, flat_targets).reshape(n, t)
        # The acceptance draw's stream is independent of the Gumbel noise of the same position.
        u = _uniform(keys, 1, stream=1).reshape(n, t)
        return draws, u < p

    is_sampled = (s.temperature > 0)[:, None]
    draws, lucky = jax.lax.cond(jnp.any(is_sampled), sampled, lambda: (greedy, jnp.zeros((n, t), bool)))
    accept = (targets >= 0) & jnp.where(is_sampled, lucky, greedy == targets)
    return _accepted_run(targets, accept, jnp.where(is_sampled, draws, greedy))
