"""Draft heads: a small recurrent drafter on the target model's own last hidden state.

The heads see what the target saw: after a step, the final-normed hidden state `h` at the position of
the step's last output token `x` (the state the target sampled `x` from). Draft i (i = 1..depth) comes
from one residual block per depth over the running state and the token before it:

    z_0 = h,   t_1 = x
    z_i = z_{i-1} + silu([z_{i-1}, e(t_i)] @ w[i].T + b[i])  e(t): the target's embedding of t at unit RMS
    t_{i+1} = vocab[argmax(rms_norm(z_i, norm) @ out.T)]      the draft for the position after t_i

Each head conditions on the tokens drafted before it (as Hydra and ReDrafter heads do; Medusa heads
see only `h`, which loses most of their accuracy past the first), needs no KV cache of its own and
costs two small matrix products per draft. The output layer covers a draft vocabulary: the tokens the
target produces most often in its own text (EAGLE-3 prunes its draft vocabulary the same way), so a
draft does not pay for the full vocabulary's logits; a target token outside it is never drafted.

Training (scripts/train_draft_heads.py) fits the heads with optax on text the target model generated
itself, teacher-forced: `unroll_logits` runs the same blocks over the true next tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.kernel_dispatch import linear
from jaxinfer.models.params import Params
from jaxinfer.models.transformer import XLA_KERNELS, embed_tokens, rms_norm
from jaxinfer.quantization import add_vnni
from jaxinfer.speculation.config import depth_threshold, min_probabilities
from jaxinfer.weight_formats import quantize_int8

HEADS_FILE = "draft_heads.json"
FORMAT = "jaxinfer-draft-heads"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftHeads:
    """The heads' weights (float32); `depth` drafts at most."""

    w: jax.Array | tuple  # [depth, hidden, 2 * hidden] (out, in); served: a weight per depth (for_serving)
    b: jax.Array  # [depth, hidden]
    norm: jax.Array  # [hidden]
    out: jax.Array  # [draft_vocab, hidden]
    vocab: jax.Array  # [draft_vocab] int32: the target token id of each draft-vocabulary entry

    @property
    def depth(self) -> int:
        return self.b.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.b.shape[1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ServedHeads:
    """What a serving step drafts with: the heads as for_serving lays them out and the probability
    each depth's draft needs under its head, [depth] float32 (an argument of the step programs, so
    warm-up can choose it from the step costs it measures without compiling again)."""

    heads: DraftHeads
    min_probability: jax.Array


def init_heads(key: jax.Array, hidden_size: int, depth: int, vocab: jax.Array, out: jax.Array) -> DraftHeads:
    """Fresh heads: small block weights (each block starts near the identity), the output layer from
    `out` [draft_vocab, hidden] (the target's output rows of the draft vocabulary)."""
    w = jax.random.normal(key, (depth, hidden_size, 2 * hidden_size), jnp.float32)
    return DraftHeads(
        w=w * (0.1 / jnp.sqrt(2.0 * hidden_size)),
        b=jnp.zeros((depth, hidden_size), jnp.float32),
        norm=jnp.ones((hidden_size,), jnp.float32),
        out=jnp.asarray(out, jnp.float32),
        vocab=jnp.asarray(vocab, jnp.int32),
    )


def unit_rms(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def token_features(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """e(t): the target's embeddings of `tokens` [...] at unit RMS, [..., hidden] float32."""
    flat = tokens.reshape(1, -1)
    e = embed_tokens(params, config, flat)[0]
    return unit_rms(e).reshape(*tokens.shape, -1)


def head_step(
    heads: DraftHeads, i: int, z: jax.Array, e: jax.Array, kernels: KernelConfig = XLA_KERNELS
) -> tuple[jax.Array, jax.Array]:
    """One block: state z [..., hidden] and the token features e [..., hidden] -> (the next state,
    its draft-vocabulary logits [..., draft_vocab])."""
    z = z + jax.nn.silu(linear(jnp.concatenate([z, e], axis=-1), heads.w[i], kernels) + heads.b[i])
    return z, linear(rms_norm(z, heads.norm, 1e-6), heads.out, kernels)


def for_serving(heads: DraftHeads, kernels: KernelConfig) -> DraftHeads:
    """The heads as a decode step reads them: with the native CPU kernels, int8 blocks and output layer
    in the VNNI kernel's layout. A step runs the heads at one row per request, where reading ~10 MB of
    float32 weights three times would cost a third of a SmolLM2 step; int8 reads a quarter of that."""
    if kernels.matmul != "native":
        return heads
    blocks = tuple(add_vnni(quantize_int8(heads.w[i])) for i in range(heads.depth))
    return dataclasses.replace(heads, w=blocks, out=add_vnni(quantize_int8(heads.out)))


def propose(
    heads: DraftHeads,
    params: Params,
    config: ModelConfig,
    hidden: jax.Array,  # [rows, hidden]: the target's final-normed state at each row's last token
    token: jax.Array,  # [rows] int32: each row's last output token
    num_drafts: int,
    kernels: KernelConfig = XLA_KERNELS,
    min_probability: float | Sequence[float] | jax.Array = 0.0,
    drafting: jax.Array | None = None,  # [rows] bool: the rows that draft (default: all)
) -> jax.Array:
    """Greedy drafts [rows, num_drafts] int32 for the positions after `token`, -1 from the first draft
    whose probability under its head falls below `min_probability` (a threshold per depth, the last
    for every deeper draft: config.min_probabilities; or an array [num_drafts], a program's argument
    that can change without compiling again): a row drafts only what its heads are sure of,
    so an unsure step verifies few positions or none (a verification costs more per position it runs;
    the engine picks the narrowest width that holds the batch's drafts).

    A head runs only while some drafting row is still sure: a step where no row drafts with the heads
    (prompt lookup, or speculation paused) or whose heads doubt early skips the rest of them."""
    if not isinstance(min_probability, jax.Array):
        thresholds = min_probabilities(min_probability)
        min_probability = [depth_threshold(thresholds, i) for i in range(num_drafts)]
    log_min = jnp.log(jnp.asarray(min_probability, jnp.float32))  # log(0) = -inf: every draft is sure
    sure = jnp.ones(token.shape, bool) if drafting is None else drafting
    drafts = jnp.full((*token.shape, num_drafts), -1, jnp.int32)

    def draft(i, carry):
        z, token, sure, drafts = carry
        z, logits = head_step(heads, i, z, token_features(params, config, token), kernels)
        best = jnp.argmax(logits, axis=-1)
        top = jnp.take_along_axis(logits, best[:, None], axis=-1)[:, 0]
        sure &= top - jax.nn.logsumexp(logits, axis=-1) >= log_min[i]
        token = heads.vocab[best].astype(jnp.int32)
        return z, token, sure, drafts.at[:, i].set(jnp.where(sure, token, -1))

    carry = (hidden.astype(jnp.float32), token.astype(jnp.int32), sure, drafts)
    for i in range(num_drafts):
        carry = jax.lax.cond(jnp.any(carry[2]), functools.partial(draft, i), lambda c: c, carry)
    return carry[3]


def unroll_logits(heads: DraftHeads, hidden: jax.Array, features: jax.Array) -> jax.Array:
    """Teacher-forced drafts (training): hidden [n, hidden] and the features of the true tokens after
    it [n, depth, hidden] -> draft-vocabulary logits [n, depth, draft_vocab]."""
    z, out = hidden.astype(jnp.float32), []
    for i in range(heads.depth):
        z, logits = head_step(heads, i, z, features[:, i])
        out.append(logits)
    return jnp.stack(out, axis=1)


def save_heads(directory: str | Path, heads: DraftHeads, info: dict) -> None:
    """Writes the heads (orbax) and `info` (JSON: the target model, the training run) to `directory`."""
    import orbax.checkpoint as ocp  # heavy import; only checkpoint users pay for it

    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "weights", heads, force=True)
        checkpointer.wait_until_finished()
    record = {"format": FORMAT, "depth": heads.depth, "hidden_size": heads.hidden_size,
              "draft_vocab": int(heads.vocab.shape[0]), **info}  # fmt: skip
    (directory / HEADS_FILE).write_text(json.dumps(record, indent=2))


def load_heads(directory: str | Path, config: ModelConfig) -> tuple[DraftHeads, dict]:
    """Reads heads saved by save_heads; ValueError when they do not fit `config`'s model."""
    import orbax.checkpoint as ocp

    directory = Path(directory).expanduser().resolve()
    try:
        record = json.loads((directory / HEADS_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{directory} holds no draft heads ({HEADS_FILE}: {e})") from None
    if record.get("format") != FORMAT:
        raise ValueError(f"{directory / HEADS_FILE} is not a {FORMAT} file")
    if record["hidden_size"] != config.hidden_size or record.get("vocab_size", config.vocab_size) != (
        config.vocab_size
    ):
        raise ValueError(
            f"draft heads in {directory} were trained for hidden size {record['hidden_size']} and "
            f"vocabulary {record.get('vocab_size')}, not this model's {config.hidden_size} / "
            f"{config.vocab_size}"
        )
    h, d, v = record["hidden_size"], record["depth"], record["draft_vocab"]
    target = DraftHeads(
        w=jax.ShapeDtypeStruct((d, h, 2 * h), jnp.float32),
        b=jax.ShapeDtypeStruct((d, h), jnp.float32),
        norm=jax.ShapeDtypeStruct((h,), jnp.float32),
        out=jax.ShapeDtypeStruct((v, h), jnp.float32),
        vocab=jax.ShapeDtypeStruct((v,), jnp.int32),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        heads = checkpointer.restore(directory / "weights", target)
    return heads, record
