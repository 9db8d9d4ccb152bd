"""Training the draft heads (draft_heads.py) on text the target model generated itself.

Why self-generated text: the heads must guess what *this* model will say next, so the best data is the
model's own output (Medusa-2 and EAGLE train on self-distilled text the same way). The labels are the
target's own greedy choices, not the text's next tokens: where an answer was sampled, its next token is
often not the one greedy verification would accept, and a head trained on it learns the sampler's noise.
Sampled answers still serve: they put the target in contexts greedy decoding would not reach. Beside
the greedy choice, the target's probabilities of its top choices can be the targets (distillation, as
Medusa-2 and DistillSpec train): they tell a head how close the runners-up were, a richer signal per
example than one label, and held out the distilled heads accept more drafts.

The pipeline: `hidden_states` runs the target once over every whole sequence (prompt + response) for
its hidden states and top next tokens, `training_examples` cuts each response into (h_t,
x[t+1..t+depth], g[t+1..t+depth]) examples (g[p]: the target's greedy token after position p),
`train_heads` fits the heads with optax AdamW on the masked cross-entropy of `unroll_logits` and reports
held-out accuracy per depth and the expected accepted drafts per step: the teacher-forced chain, cut
where the text leaves the greedy path, is exactly what greedy verification accepts from those states.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.cpu_kernels.int4_matmul import unpack_int4
from jaxinfer.kernel_dispatch import embed
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.models.params import Params
from jaxinfer.models.transformer import XLA_KERNELS, forward_hidden, output_logits
from jaxinfer.sharding import make_mesh
from jaxinfer.speculation.config import DEFAULT_DRAFT_MIN_PROBABILITY, depth_threshold, min_probabilities
from jaxinfer.speculation.draft_heads import DraftHeads, init_heads, token_features, unroll_logits
from jaxinfer.speculation.thresholds import HeldOutDrafts
from jaxinfer.weight_formats import PackedInt4Weight

PAGE_SIZE = 64  # positions per page of the throwaway cache (the CPU engine's default)
TOKENS_PER_BATCH = 4096  # rows x padded length of one forward pass: big products, bounded attention memory
LOGITS_CHUNK = 512  # positions whose full-vocabulary logits exist at once (Gemma 3: 512 MB in float32)
EVAL_BATCH = 1024
HELD_OUT_DRAFTS = 16384  # held-out positions kept with the heads to choose thresholds (thresholds.py)
TEACHER_TOP_K = 16  # the target's choices a distilled head learns per position (~0.9 of its mass)


def teacher_top_k(soft_weight: float) -> int:
    """How many of the target's top choices per position training at `soft_weight` (the share of the
    distilled loss, in [0, 1]) needs: TEACHER_TOP_K to distil, the greedy one alone without."""
    if not 0.0 <= soft_weight <= 1.0:
        raise ValueError(f"soft_weight must lie in [0, 1], got {soft_weight}")
    return TEACHER_TOP_K if soft_weight > 0 else 1


# --------------------------------------------------------------------------------------------------
# The target's hidden states and output rows
# --------------------------------------------------------------------------------------------------


def length_bucket(n: int) -> int:
    """The padded length of an n-token sequence: 64 x a power of two or 1.5 x one (64, 128, 192, 256,
    384, 512, 768, ...), so a corpus compiles a handful of programs and wastes at most a third."""
    size = PAGE_SIZE
    while size < n:
        size *= 2
    if size >= 4 * PAGE_SIZE and size * 3 // 4 >= n:
        size = size * 3 // 4
    return size


@functools.partial(jax.jit, static_argnames=("config", "kernels", "top_k"), donate_argnames=("cache",))
def _forward_hidden(params, config, tokens, positions, cache, page_table, kernels, top_k):
    """(hidden [b, t, hidden], the target's top_k next tokens [b, t, top_k] int32 best first, their
    log-probabilities [b, t, top_k] float32, cache): the logits of LOGITS_CHUNK positions at a time, so
    the full-vocabulary logits of a batch never exist at once."""
    x, cache = forward_hidden(params, config, tokens, positions, cache, page_table, kernels=kernels)
    flat = x.reshape(-1, x.shape[-1])
    pad = -flat.shape[0] % LOGITS_CHUNK
    chunks = jnp.pad(flat, ((0, pad), (0, 0))).reshape(-1, LOGITS_CHUNK, flat.shape[-1])

    def top(chunk):
        logits = output_logits(params, config, chunk, kernels).astype(jnp.float32)
        values, ids = jax.lax.top_k(logits, top_k)  # ties: the lower id first, as argmax
        return ids.astype(jnp.int32), values - jax.nn.logsumexp(logits, axis=-1, keepdims=True)

    ids, logprobs = jax.lax.map(top, chunks)
    shape = (*x.shape[:-1], top_k)
    ids, logprobs = (a.reshape(-1, top_k)[: flat.shape[0]].reshape(shape) for a in (ids, logprobs))
    return x, ids, logprobs, cache


def hidden_states(
    params: Params,
    config: ModelConfig,
    sequences: Sequence[Sequence[int]],
    kernels: KernelConfig = XLA_KERNELS,
    *,
    cache_dtype: str = "float32",
    tokens_per_batch: int = TOKENS_PER_BATCH,
    top_k: int = 1,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(hidden, choices, logprobs): each sequence's final-normed hidden states [len, hidden] float32,
    the target's top_k next tokens after each position [len, top_k] int32, best first (choices[:, 0]:
    its greedy choice, the argmax of its logits), and their log-probabilities [len, top_k] float32, from
    one causal pass over the whole sequence (forward_hidden with `kernels` and a `cache_dtype` KV cache:
    pass the engine's own so the heads see the states, and learn the choices, the engine will have).

    Sequences of one length bucket run together, a fixed number of rows per bucket (padding rows and
    positions are -1: nothing is written, their outputs are dropped), so every batch reuses one of a
    few compiled programs; the throwaway cache of each bucket is donated from batch to batch.
    """
    out: list[np.ndarray | None] = [None] * len(sequences)
    choices: list[np.ndarray | None] = [None] * len(sequences)
    logprobs: list[np.ndarray | None] = [None] * len(sequences)
    by_bucket: dict[int, list[int]] = {}
    for index, seq in enumerate(sequences):
        if len(seq) == 0:
            out[index] = np.zeros((0, config.hidden_size), np.float32)
            choices[index] = np.zeros((0, top_k), np.int32)
            logprobs[index] = np.zeros((0, top_k), np.float32)
        else:
            by_bucket.setdefault(length_bucket(len(seq)), []).append(index)
    mesh = make_mesh()
    for length, members in sorted(by_bucket.items()):
        rows = max(1, tokens_per_batch // length)
        pages = length // PAGE_SIZE
        cache_config = CacheConfig(
            num_pages=rows * pages + 1, page_size=PAGE_SIZE, max_len=length, num_slots=rows, dtype=cache_dtype
        )
        cache = init_cache(config, cache_config, mesh)
        page_table = jnp.asarray(contiguous_page_table(rows, pages))
        for start in range(0, len(members), rows):
            batch = members[start : start + rows]
            tokens = np.zeros((rows, length), np.int32)
            positions = np.full((rows, length), -1, np.int32)
            for r, index in enumerate(batch):
                n = len(sequences[index])
                tokens[r, :n] = sequences[index]
                positions[r, :n] = np.arange(n)
            x, ids, lp, cache = _forward_hidden(
                params, config, jnp.asarray(tokens), jnp.asarray(positions), cache, page_table, kernels, top_k
            )
            x, ids, lp = np.asarray(x.astype(jnp.float32)), np.asarray(ids), np.asarray(lp)
            for r, index in enumerate(batch):
                n = len(sequences[index])
                out[index], choices[index], logprobs[index] = x[r, :n], ids[r, :n], lp[r, :n]
    return out, choices, logprobs  # type: ignore[return-value]


def output_rows(params: Params, config: ModelConfig, ids: np.ndarray | jax.Array) -> jax.Array:
    """The target's output-layer rows [len(ids), hidden] float32 for token `ids`: the tied embedding
    table or lm_head, dequantised row by row whatever its format (no embed_scale: the logits
    projection does not apply it)."""
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    if isinstance(head, PackedInt4Weight):  # the CPU kernel's layout has no row lookup of its own
        head = unpack_int4(head)
    return embed(head, jnp.asarray(ids, jnp.int32), jnp.float32)


# --------------------------------------------------------------------------------------------------
# Examples
# --------------------------------------------------------------------------------------------------


def draft_vocabulary(sequences: Sequence[Sequence[int]], vocab_size: int, size: int) -> np.ndarray:
    """The `size` most frequent token ids of `sequences` (-1, no token, not counted), most frequent first
    (ties by id), int32; tokens that never occur fill the rest by id when the text has fewer distinct
    ones."""
    size = min(size, vocab_size)
    text = np.concatenate([np.asarray(seq, np.int64).ravel() for seq in sequences] or [np.zeros(0, np.int64)])
    text = text[text >= 0]
    counts = np.bincount(text, minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return order[:size].astype(np.int32)


def draft_indexer(vocab: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """A function from tokens to their indices in the draft vocabulary `vocab`, -1 where a token is not
    in it (the vocabulary sorted once for every call)."""
    order = np.argsort(vocab, kind="stable")
    sorted_vocab = vocab[order]

    def index(tokens: np.ndarray) -> np.ndarray:
        pos = np.clip(np.searchsorted(sorted_vocab, tokens), 0, len(vocab) - 1)
        return np.where(sorted_vocab[pos] == tokens, order[pos], -1).astype(np.int32)

    return index


@dataclasses.dataclass
class Examples:
    """Teacher-forced examples: the head at depth i sees z from `hidden` and token inputs[:, i], and
    should predict the draft-vocabulary entry targets[:, i] (-1: outside the draft vocabulary).
    on_path[:, i]: inputs[:, i] is the token the draft before it should have been (always for i = 0),
    so a chain of right drafts reaches depth i in verification only where on_path holds up to i."""

    hidden: np.ndarray  # [n, hidden] float32: h_t
    inputs: np.ndarray  # [n, depth] int32 token ids x[t+1 .. t+depth]
    targets: np.ndarray  # [n, depth] int32 draft-vocabulary indices of the labels g[t+1 .. t+depth], or -1
    on_path: np.ndarray  # [n, depth] bool: x[t+1+i] == g[t+i] for i >= 1
    # The target's top choices where the labels come from (training_examples' `teacher`), else None:
    soft_targets: np.ndarray | None = None  # [n, depth, k] int32 draft-vocabulary indices, or -1
    soft_probs: np.ndarray | None = None  # [n, depth, k] float32: the target's probability of each

    def __len__(self) -> int:
        return len(self.hidden)


def training_examples(
    sequences: Sequence[Sequence[int]],
    hidden: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    first_output_index: Sequence[int],
    depth: int,
    vocab: np.ndarray,
    teacher: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
) -> Examples:
    """One example per position t of each sequence from first_output_index - 1 on (the states whose
    next token the model generated) whose next depth + 1 tokens exist. labels[i][p]: the token a draft
    for the position after p should be, the target's greedy choice there (hidden_states), -1 for none.
    teacher[i]: (ids [len, k], log-probabilities [len, k]) of the target's top k choices after each
    position (hidden_states' `top_k`), the soft targets of the same drafts."""
    parts_h, parts_in, parts_out, parts_path, parts_soft, parts_probs = [], [], [], [], [], []
    offsets = np.arange(depth)
    index = draft_indexer(vocab)
    teachers = teacher if teacher is not None else [None] * len(sequences)
    for seq, h, g, first, top in zip(sequences, hidden, labels, first_output_index, teachers):
        x, g = np.asarray(seq, np.int32), np.asarray(g, np.int32)
        start, stop = max(first - 1, 0), len(x) - depth - 1  # t in [start, stop)
        if stop <= start:
            continue
        t = np.arange(start, stop)[:, None] + offsets  # [n, depth]
        parts_h.append(np.asarray(h[start:stop], np.float32))
        parts_in.append(x[t + 1])
        parts_out.append(index(g[t + 1]))
        parts_path.append((x[t + 1] == g[t]) | (offsets == 0))
        if top is not None:
            ids, logprobs = top
            parts_soft.append(index(np.asarray(ids)[t + 1]))
            parts_probs.append(np.exp(np.asarray(logprobs, np.float32)[t + 1]))
    if not parts_h:
        width = hidden[0].shape[-1] if len(hidden) else 0
        empty = np.zeros((0, depth), np.int32)
        return Examples(np.zeros((0, width), np.float32), empty, empty.copy(), np.zeros((0, depth), bool))
    soft = (np.concatenate(parts_soft), np.concatenate(parts_probs)) if teacher is not None else (None, None)
    return Examples(*(np.concatenate(p) for p in (parts_h, parts_in, parts_out, parts_path)), *soft)


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def _heads(trained: dict[str, jax.Array], fixed: dict[str, jax.Array]) -> DraftHeads:
    """The heads from the fields being trained and the fixed ones (`vocab`, and `out` when frozen)."""
    return DraftHeads(**trained, **fixed)


def _logits(trained, fixed, hidden, table, inputs):
    """Teacher-forced draft logits [n, depth, draft_vocab] of examples whose input tokens are rows of the
    feature table `table`."""
    return unroll_logits(_heads(trained, fixed), hidden, jnp.take(table, inputs, axis=0))


def _loss(trained, fixed, hidden, table, inputs, targets, soft, soft_weight):
    """Mean cross-entropy over the targets inside the draft vocabulary; with soft = (soft_targets,
    soft_probs), mixed at `soft_weight` with the cross-entropy against the target's top choices inside
    the draft vocabulary (their probabilities renormalised: distillation)."""
    logits = _logits(trained, fixed, hidden, table, inputs)
    log_q = jax.nn.log_softmax(logits, axis=-1)
    valid = targets >= 0
    nll = -jnp.take_along_axis(log_q, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    hard = jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)
    if soft is None:
        return hard
    soft_targets, soft_probs = soft
    p = jnp.where(soft_targets >= 0, soft_probs, 0.0)
    mass = jnp.sum(p, axis=-1)
    picked = jnp.take_along_axis(log_q, jnp.maximum(soft_targets, 0), axis=-1)
    cross = -jnp.sum(p * picked, axis=-1) / jnp.maximum(mass, 1e-9)
    covered = mass > 0
    distilled = jnp.sum(jnp.where(covered, cross, 0.0)) / jnp.maximum(jnp.sum(covered), 1)
    return (1.0 - soft_weight) * hard + soft_weight * distilled


@functools.partial(
    jax.jit, static_argnames=("optimizer", "soft_weight"), donate_argnames=("trained", "opt_state")
)
def _train_step(
    optimizer, trained, opt_state, fixed, hidden, table, inputs, targets, soft, batch, soft_weight
):
    """One AdamW step on the examples `batch` [batch_size] of the device-resident training set."""
    soft = None if soft is None else (soft[0][batch], soft[1][batch])
    loss, grads = jax.value_and_grad(_loss)(
        trained, fixed, hidden[batch], table, inputs[batch], targets[batch], soft, soft_weight
    )
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("min_probability",))
def _eval_batch(trained, fixed, hidden, table, inputs, targets, on_path, weight, min_probability):
    """Sums over a batch: (loss numerator, valid targets, correct drafts per depth [depth], accepted
    drafts, drafts sure at `min_probability`, accepted sure drafts), each example counted `weight`
    (0 for padding)."""
    logits = _logits(trained, fixed, hidden, table, inputs)
    valid = targets >= 0
    picked = jnp.take_along_axis(logits, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    lse = jax.nn.logsumexp(logits, axis=-1)
    correct, chain = _verified(logits, targets, on_path)
    log_thresholds = jnp.log(jnp.asarray(
        [max(depth_threshold(min_probability, i), 1e-30) for i in range(logits.shape[1])]
    ))  # fmt: skip
    sure = jnp.cumprod(jnp.max(logits, axis=-1) - lse >= log_thresholds, axis=-1)
    w = weight[:, None]
    return (
        jnp.sum(jnp.where(valid, lse - picked, 0.0) * w),
        jnp.sum(valid * w),
        jnp.sum(correct * w, axis=0),
        jnp.sum(chain * w),
        jnp.sum(sure * w),
        jnp.sum(sure * chain * w),
    )


@jax.jit
def _draft_outcomes(trained, fixed, hidden, table, inputs, targets, on_path):
    """Per example: the probability of each depth's draft under its head [n, depth] and the drafts
    greedy verification accepts in a row [n]."""
    logits = _logits(trained, fixed, hidden, table, inputs)
    probability = jnp.exp(jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1))
    return probability, jnp.sum(_verified(logits, targets, on_path)[1], axis=-1)


def _verified(logits, targets, on_path):
    """(correct, chain) [n, depth]: each depth's draft is the target's choice (a target outside the
    draft vocabulary is never drafted), and greedy verification accepts the drafts up to it."""
    correct = (jnp.argmax(logits, axis=-1) == targets) & (targets >= 0)
    return correct, jnp.cumprod(correct & on_path, axis=-1)


def held_out_drafts(
    trained,
    fixed,
    table,
    examples: Examples,
    feature_index: np.ndarray,
    limit: int = HELD_OUT_DRAFTS,
    seed: int = 0,
) -> HeldOutDrafts:
    """The heads' drafts at up to `limit` of `examples` (a random sample): what thresholds.py prices."""
    pick = np.sort(np.random.default_rng(seed).permutation(len(examples))[:limit])
    probability, accepted = [], []
    for start in range(0, len(pick), EVAL_BATCH):
        rows = pick[start : start + EVAL_BATCH]
        p, a = _draft_outcomes(
            trained, fixed, _padded(examples.hidden[rows], 0), table, _padded(feature_index[rows], 0),
            _padded(examples.targets[rows], -1), _padded(examples.on_path[rows], False),
        )  # fmt: skip
        probability.append(np.asarray(p)[: len(rows)])
        accepted.append(np.asarray(a)[: len(rows)])
    depth = examples.inputs.shape[1]
    if not probability:
        return HeldOutDrafts(np.zeros((0, depth), np.float32), np.zeros(0, np.int32))
    return HeldOutDrafts(np.concatenate(probability), np.concatenate(accepted))


def _padded(a: np.ndarray, fill) -> jax.Array:
    """a [rows, ...] padded with `fill` to EVAL_BATCH rows (one compiled evaluation shape)."""
    pad = np.full((EVAL_BATCH - len(a), *a.shape[1:]), fill, a.dtype)
    return jnp.asarray(np.concatenate([a, pad]))


def evaluate(
    trained,
    fixed,
    table,
    examples: Examples,
    feature_index: np.ndarray,
    min_probability: float | Sequence[float] = DEFAULT_DRAFT_MIN_PROBABILITY,
) -> dict:
    """Teacher-forced metrics: loss, top-1 accuracy per depth (a target outside the draft vocabulary
    counts as missed), the share of targets inside it, the mean accepted drafts per step under greedy
    chain acceptance (sum over depths of the product of correctness so far, cut where the text leaves
    the greedy path), and with drafts cut at the first one below `min_probability` (per depth, as the
    engine drafts: draft_heads.propose) the drafts and accepted drafts per step."""
    min_probability = min_probabilities(min_probability)
    n, depth = len(examples), examples.inputs.shape[1]
    if n == 0:
        return {"examples": 0}
    totals = [0.0, 0.0, np.zeros(depth), 0.0, 0.0, 0.0]
    for start in range(0, n, EVAL_BATCH):
        rows = slice(start, min(start + EVAL_BATCH, n))
        weight = _padded(np.ones(n, np.float32)[rows], 0)
        sums = _eval_batch(
            trained, fixed, _padded(examples.hidden[rows], 0), table, _padded(feature_index[rows], 0),
            _padded(examples.targets[rows], -1), _padded(examples.on_path[rows], False), weight,
            min_probability,
        )  # fmt: skip
        for i, s in enumerate(sums):
            totals[i] = totals[i] + np.asarray(s, np.float64)
    loss_sum, valid, correct, accepted, sure, sure_accepted = totals
    return {
        "examples": n,
        "loss": float(loss_sum / max(valid, 1.0)),
        "in_draft_vocab": float(valid / (n * depth)),
        "accuracy": [round(float(c / n), 4) for c in correct],
        "accepted_per_step": float(accepted / n),
        "sure": {
            "min_probability": list(min_probability),
            "drafts_per_step": float(sure / n),
            "accepted_per_step": float(sure_accepted / n),
        },
    }


def split_sequences(
    count: int, holdout_fraction: float, seed: int, groups: Sequence[int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(train, holdout) sequence indices: whole sequences are held out, so no held-out example shares
    a response with a training one; with `groups` (a group id per sequence, e.g. its prompt), whole
    groups are, so no held-out answer shares a prompt with a training one."""
    group_of = np.arange(count) if groups is None else np.asarray(groups)
    if len(group_of) != count:
        raise ValueError(f"{len(group_of)} group ids for {count} sequences")
    distinct = np.unique(group_of)
    order = np.random.default_rng(seed).permutation(len(distinct))
    held = min(len(distinct) - 1, math.ceil(holdout_fraction * len(distinct))) if holdout_fraction > 0 else 0
    held_out = np.isin(group_of, distinct[order[:held]])
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def train_heads(
    params: Params,
    config: ModelConfig,
    sequences: Sequence[Sequence[int]],
    first_output_index: Sequence[int],
    *,
    depth: int = 3,
    draft_vocab: int = 4096,
    steps: int = 800,
    batch_size: int = 256,
    learning_rate: float = 3e-3,
    weight_decay: float = 1e-4,
    train_output: bool = True,
    seed: int = 0,
    holdout_fraction: float = 0.1,
    groups: Sequence[int] | None = None,
    hidden: Sequence[np.ndarray] | None = None,
    labels: Sequence[np.ndarray] | None = None,
    teacher: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
    soft_weight: float = 0.0,
    kernels: KernelConfig = XLA_KERNELS,
    cache_dtype: str = "float32",
    log: Callable[[str], None] | None = None,
) -> tuple[DraftHeads, dict]:
    """Fits draft heads of `depth` over a `draft_vocab`-token draft vocabulary to `sequences` (prompt +
    the target's own response, the response starting at first_output_index[i]).

    hidden, labels, teacher: the sequences' hidden states, greedy next tokens and top choices with
    their log-probabilities when already computed (hidden_states), else computed here with `kernels`
    and `cache_dtype`; the heads learn the labels (-1: none), and with soft_weight > 0 the target's
    distribution over its top choices (distillation: a mixture of both losses). train_output=False
    keeps the output rows at the target's own (fewer parameters to fit; on SmolLM2 it generalised no
    better). The draft vocabulary and the training examples come from the training split;
    `holdout_fraction` of the sequences (of the `groups`, when given: sequence i belongs to group
    groups[i], e.g. several answers to one prompt) measure the result.
    The heads returned are those of the checkpoint (every tenth of the steps) that accepted the most
    held-out drafts per step: with a few hundred answers the heads soon learn the training text by heart.
    Returns the heads and metrics: "holdout" (evaluate's dict), "train" (the same on up to 4096 training
    examples), "best_step", "loss_start" (the first batch's loss, before any update), "loss_end" (the
    mean over the last 50 steps), "held_out_drafts" (the returned heads' drafts at held-out
    positions: what thresholds.py prices to choose draft thresholds) and the sizes.
    """
    if len(sequences) != len(first_output_index):
        raise ValueError(f"{len(sequences)=} but {len(first_output_index)=}")
    top_k = teacher_top_k(soft_weight)
    soft = soft_weight > 0
    if hidden is None or labels is None or (soft and teacher is None):
        computed, choices, logprobs = hidden_states(
            params, config, sequences, kernels, cache_dtype=cache_dtype, top_k=top_k
        )
        hidden = computed if hidden is None else hidden
        labels = [c[:, 0] for c in choices] if labels is None else labels
        teacher = list(zip(choices, logprobs)) if soft and teacher is None else teacher
    train_ids, hold_ids = split_sequences(len(sequences), holdout_fraction, seed, groups)

    def pick(ids: np.ndarray) -> tuple[list, list, list, list]:
        return tuple([column[i] for i in ids] for column in (sequences, hidden, labels, first_output_index))

    train_split = pick(train_ids)
    # The draft vocabulary: the target's most frequent greedy choices in the answers.
    answers = [g[first - 1 :] for g, first in zip(train_split[2], train_split[3])]
    vocab = draft_vocabulary(answers, config.vocab_size, draft_vocab)
    train = training_examples(*train_split, depth, vocab, [teacher[i] for i in train_ids] if soft else None)
    holdout = training_examples(*pick(hold_ids), depth, vocab)
    if len(train) == 0:
        raise ValueError(f"no training examples: every response is shorter than {depth + 2} tokens")

    # Token features e(t) once per distinct input token; examples index this table.
    distinct = np.unique(np.concatenate([train.inputs.ravel(), holdout.inputs.ravel()]))
    table = token_features(params, config, jnp.asarray(distinct, jnp.int32))

    def feature_index(inputs: np.ndarray) -> np.ndarray:
        return np.searchsorted(distinct, inputs).astype(np.int32)

    key = jax.random.key(seed)
    heads = init_heads(key, config.hidden_size, depth, vocab, output_rows(params, config, vocab))
    frozen = ("vocab",) if train_output else ("vocab", "out")
    fields = [f.name for f in dataclasses.fields(DraftHeads)]
    trained = {name: getattr(heads, name) for name in fields if name not in frozen}
    fixed = {name: getattr(heads, name) for name in frozen}
    warmup = min(100, max(1, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
        end_value=0.05 * learning_rate,
    )  # fmt: skip
    decay_mask = {name: name == "w" for name in trained}  # norms, biases and output rows: no decay
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, weight_decay=weight_decay, mask=decay_mask),
    )
    opt_state = optimizer.init(trained)

    hidden_dev = jnp.asarray(train.hidden)
    inputs_dev = jnp.asarray(feature_index(train.inputs))
    targets_dev = jnp.asarray(train.targets)
    soft_dev = (jnp.asarray(train.soft_targets), jnp.asarray(train.soft_probs)) if soft else None
    rng = np.random.default_rng(seed + 1)
    batch_size = min(batch_size, len(train))
    order, cursor, losses = rng.permutation(len(train)), 0, []
    hold_index = feature_index(holdout.inputs)
    best, best_step, best_holdout = trained, 0, None  # best_holdout: evaluate's dict of `best`
    interval = max(1, steps // 10)
    start = time.perf_counter()
    for step in range(steps):
        if cursor + batch_size > len(order):  # a new epoch
            order, cursor = rng.permutation(len(train)), 0
        batch = jnp.asarray(order[cursor : cursor + batch_size], jnp.int32)
        cursor += batch_size
        trained, opt_state, loss = _train_step(
            optimizer,
            trained,
            opt_state,
            fixed,
            hidden_dev,
            table,
            inputs_dev,
            targets_dev,
            soft_dev,
            batch,
            soft_weight if soft else 0.0,
        )
        losses.append(loss)
        if (step + 1) % interval == 0 or step + 1 == steps:
            held = evaluate(trained, fixed, table, holdout, hold_index)
            accepted = held.get("accepted_per_step", -1.0)
            # No held-out examples: keep the latest. A copy: the next step donates `trained`.
            if not len(holdout) or best_holdout is None or accepted > best_holdout["accepted_per_step"]:
                best, best_step, best_holdout = jax.tree.map(jnp.copy, trained), step + 1, held
            if log is not None:
                recent = float(np.mean(np.asarray(jnp.stack(losses[-50:]))))
                log(f"step {step + 1}/{steps}: loss {recent:.3f}, held-out accepted drafts per step "
                    f"{accepted:.3f} ({time.perf_counter() - start:.1f}s)")  # fmt: skip
    trained = best
    losses_np = np.asarray(jnp.stack(losses)) if losses else np.zeros(0)

    sample = np.random.default_rng(seed + 2).permutation(len(train))[:4096]
    train_sample = Examples(
        train.hidden[sample], train.inputs[sample], train.targets[sample], train.on_path[sample]
    )
    metrics = {
        "depth": depth,
        "draft_vocab": int(len(vocab)),
        "sequences": {"train": len(train_ids), "holdout": len(hold_ids)},
        "examples": {"train": len(train), "holdout": len(holdout)},
        "steps": steps,
        "batch_size": batch_size,
        "learning_rate": learning_rate,
        "soft_weight": soft_weight,
        "best_step": best_step,
        "loss_start": float(losses_np[0]) if len(losses_np) else None,  # before the first update
        "loss_end": float(losses_np[-50:].mean()) if len(losses_np) else None,
        "train": evaluate(trained, fixed, table, train_sample, feature_index(train_sample.inputs)),
        "holdout": best_holdout or evaluate(trained, fixed, table, holdout, hold_index),
        "held_out_drafts": held_out_drafts(trained, fixed, table, holdout, hold_index, seed=seed),
    }
    return _heads(trained, fixed), metrics
