"""The transformer forward pass every model family shares, as pure functions over a params pytree.

A family's differences are ModelConfig flags read here (norm placement, q/k norms, biases, soft-capping,
local layers, mixture-of-experts MLPs); models/<family>.py says which flags a family sets.

One function serves prefill and decode: `forward` takes `tokens [batch, seq]` at absolute `positions`,
writes their K/V into the pages of the paged cache that each row's page table names, and attends over
the positions those pages hold (the table's width is a static bucket, so decode reads only as many
pages as the longest row needs).

Axis letters in einsums: b batch, t query position, s key position, k kv head, g query heads per kv head,
h head, d head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxinfer.config import KernelConfig, ModelConfig, RopeScaling
from jaxinfer.kernel_dispatch import (
    attention_bias,
    attention_native,
    attention_xla,
    decode_attention_pallas,
    embed,
    linear,
    native_attention,
    prefill_attention_pallas,
)
from jaxinfer.kv_cache import KVCache
from jaxinfer.models.moe import moe_mlp
from jaxinfer.models.params import Params

XLA_KERNELS = KernelConfig()  # the plain-JAX reference path


def sum_last_axis(x: jax.Array) -> jax.Array:
    """x [..., n] -> [..., 1]: each row summed pairwise in one fixed order (zero-padded to a power of two,
    halved by elementwise adds), whatever the number of rows. XLA:CPU's own reduction sums a row in an
    order that depends on the rows beside it (one row vs eight), so a token's hidden state would depend
    on how many tokens its step ran: a prefill chunk or a verification step would then leave slightly
    different keys and values than one-row decode steps, enough, through a bfloat16 cache and int8
    activations, to change a greedy token (SmolLM2 int4) and break speculation's greedy equality."""
    n = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, (1 << (n - 1).bit_length()) - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


# Jitted, so that a program traces and lowers the norm once per shape rather than at each of its ~70
# calls (SmolLM2's 13 step programs: 5.7 s to trace and lower instead of 7.8); XLA inlines the call, and
# the optimised program is the same.
@functools.partial(jax.jit, static_argnames="eps")
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., dim]; weight: [dim], the effective multiplier (Gemma's 1 + w already folded in)."""
    x32 = x.astype(jnp.float32)
    rms = jnp.sqrt(sum_last_axis(x32 * x32) / x.shape[-1] + eps)
    # Dividing by a full-shape array keeps the normalised rows in a buffer of their own: XLA:CPU copies a
    # multiply by rsqrt (what it rewrites x / sqrt(.) into) into the next matmul's loop and recomputes it
    # for every output column (at one row that makes SmolLM2's gate_up a quarter slower, its logits 40%).
    # `0 * x` is not folded for floats (x may be inf or NaN), so the division stays; it changes no value.
    return (x32 * weight.astype(jnp.float32) / (rms + 0.0 * x32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> jax.Array:
    """[head_dim // 2] inverse frequencies, with the configured scaling variant applied."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv_freq


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions: [batch, seq] -> cos, sin: [batch, seq, 1, head_dim] (half-split layout)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    # Divided by one, as rms_norm divides: XLA:CPU then keeps the tables in buffers of their own instead
    # of fusing cos and sin into every layer's rotation of q and of k, which evaluates them again for each
    # head. The division changes no value (`0 * x` is not folded for floats).
    one = 1.0 + 0.0 * angles
    return jnp.cos(angles) / one, jnp.sin(angles) / one


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, seq, heads, head_dim], rotated in half-split (rotate_half) form."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def gated_activation(config: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up, written as one division: silu(g) = g / (1 + exp(-g)) and gelu_tanh(g) =
    g / (1 + exp(-2z)), z = sqrt(2/pi) (g + 0.044715 g^3). XLA:CPU copies cheap elementwise producers
    into the next matmul's loop (recomputing them for every output column) but keeps a division out, so
    the down projection reads one flat buffer; that made it ~2x faster at one row."""
    g = gate.astype(jnp.float32)
    if config.activation == "gelu_tanh":
        z = math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)
        return (g * up / (1.0 + jnp.exp(-2.0 * z))).astype(gate.dtype)
    return (g * up / (1.0 + jnp.exp(-g))).astype(gate.dtype)


def _layer(
    config: ModelConfig,
    index: int,
    p: dict[str, jax.Array],
    x: jax.Array,  # [b, t, hidden]
    positions: jax.Array,  # [b, t], absolute; -1 where there is no token (padding, an idle row)
    rope: tuple[jax.Array, jax.Array],
    bias: jax.Array,  # [b, t, pages * page_size], this layer kind's attention mask as an additive bias
    cache: KVCache,
    page_table: jax.Array,  # [b, pages]
    write_at: tuple[jax.Array, jax.Array],  # (page, offset) of every token, [b, t] each
    kernels: KernelConfig,
) -> tuple[jax.Array, KVCache]:
    c = config
    b, t, _ = x.shape
    sliding = c.layer_types[index] == "sliding_attention"

    h = rms_norm(x, p["attn_norm"], c.rms_norm_eps) if c.norms != "post" else x
    if "qkv_proj" in p:  # fused at load (params.fuse_projections)
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = linear(h, p["qkv_proj"], kernels)
        if c.qkv_bias:
            qkv = qkv + p["qkv_bias"].astype(qkv.dtype)
        q, k, v = qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
    else:
        q, k, v = (linear(h, p[name], kernels) for name in ("q_proj", "k_proj", "v_proj"))
        if c.qkv_bias:
            q, k, v = (
                y + p[name].astype(y.dtype) for y, name in zip((q, k, v), ("q_bias", "k_bias", "v_bias"))
            )
    if c.qk_norm == "projection":
        q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "head":
        q, k = rms_norm(q, p["q_norm"], c.rms_norm_eps), rms_norm(k, p["k_norm"], c.rms_norm_eps)
    cos, sin = rope
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    cache = cache.write(index, *write_at, k, v)
    window = c.sliding_window if sliding else None
    # Keys per row: up to the row's last real token (0 for an idle row).
    lengths = jnp.max(positions, axis=1) + 1
    attend = dict(layer=index, scale=c.attn_scale, sliding_window=window, softcap=c.attn_logit_softcap)
    if kernels.attention == "pallas" and t == 1:
        attn = decode_attention_pallas(q, cache, page_table, lengths, interpret=kernels.interpret, **attend)
    elif native_attention(kernels, cache, c.head_dim, b * t):
        attn = attention_native(q, cache, page_table, positions, **attend)
    elif kernels.attention == "pallas":
        q_start = jnp.maximum(positions[:, 0], 0)
        attn = prefill_attention_pallas(
            q, cache, page_table, q_start, lengths, interpret=kernels.interpret, **attend
        )
    else:
        keys, values = cache.read(index, page_table)  # [kv_heads, b, pages * page_size, d]
        attn = attention_xla(q, keys, values, bias, scale=c.attn_scale, softcap=c.attn_logit_softcap)
    attn = linear(attn.reshape(b, t, c.num_heads * c.head_dim), p["o_proj"], kernels)
    if c.norms != "pre":
        attn = rms_norm(attn, p["post_attn_norm"], c.rms_norm_eps)
    x = x + attn

    h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps) if c.norms != "post" else x
    h = _mlp(c, p, h, kernels)
    if c.norms != "pre":
        h = rms_norm(h, p["post_mlp_norm"], c.rms_norm_eps)
    return x + h, cache


def _mlp(config: ModelConfig, p: dict[str, jax.Array], h: jax.Array, kernels: KernelConfig) -> jax.Array:
    """The gated MLP, dense or mixture-of-experts: [b, t, hidden] -> [b, t, hidden]."""
    if config.num_experts:
        b, t, hidden = h.shape
        out = moe_mlp(
            h.reshape(b * t, hidden), p["router"], p["expert_gate"], p["expert_up"], p["expert_down"],
            experts_per_token=config.experts_per_token, normalize=config.normalize_expert_weights,
            activation=functools.partial(gated_activation, config), kernels=kernels,
        )  # fmt: skip
        return out.reshape(b, t, hidden)
    if "gate_up_proj" in p:
        gate, up = jnp.split(linear(h, p["gate_up_proj"], kernels), 2, axis=-1)
    else:
        gate, up = linear(h, p["gate_proj"], kernels), linear(h, p["up_proj"], kernels)
    return linear(gated_activation(config, gate, up), p["down_proj"], kernels)


def embed_tokens(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens [b, t] -> the first layer's input [b, t, hidden] in the params' float dtype."""
    x = embed(params["embed"], tokens, params["final_norm"].dtype)
    if config.embed_scale != 1.0:
        # Gemma rounds the scale to the activation dtype before multiplying. The barrier keeps the
        # product as it is: fused into the first norm, XLA would fold the scale into the norm's weight
        # where that saves multiplies (from two rows on, not at one), so a token's state would depend
        # on how many tokens its step ran (a verification step or prefill chunk against decode).
        x = jax.lax.optimization_barrier(x * jnp.asarray(config.embed_scale, dtype=x.dtype))
    return x


def layer_runner(config: ModelConfig, positions: jax.Array, cache: KVCache, page_table: jax.Array):
    """What every layer of one step shares (RoPE tables, attention biases, cache slots), built once;
    returns run(index, layer_params, x, cache, kernels) -> (x, cache), one layer of the step."""
    c = config
    # Padding positions (-1) only mark writes to drop; clamp them for RoPE and masks.
    rope_pos = jnp.maximum(positions, 0)
    global_rope = rope_tables(rope_pos, rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling))
    local_rope = global_rope
    if "sliding_attention" in c.layer_types:
        local_rope = rope_tables(rope_pos, rope_inv_freq(c.head_dim, c.rope_local_theta, RopeScaling()))
    attend_len = page_table.shape[1] * cache.page_size
    global_bias = attention_bias(rope_pos, attend_len, None)
    local_bias = global_bias
    if "sliding_attention" in c.layer_types:
        local_bias = attention_bias(rope_pos, attend_len, c.sliding_window)
    write_at = cache.page_slots(page_table, positions)

    def run(index: int, layer_params, x: jax.Array, cache: KVCache, kernels: KernelConfig):
        local = c.layer_types[index] == "sliding_attention"
        rope, bias = (local_rope, local_bias) if local else (global_rope, global_bias)
        return _layer(c, index, layer_params, x, positions, rope, bias, cache, page_table, write_at, kernels)

    return run


def forward_hidden(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,  # [b, t] int32
    positions: jax.Array,  # [b, t] int32, absolute positions; -1 means no token (nothing is written)
    cache: KVCache,
    page_table: jax.Array,  # [b, pages] int32: each row's pages, covering every position it attends
    *,
    kernels: KernelConfig = XLA_KERNELS,
) -> tuple[jax.Array, KVCache]:
    """Runs the layers over new tokens: (the final-normed hidden states [b, t, hidden], cache).

    Each row attends over positions [0, pages * page_size) of its own pages, causally; the width of
    `page_table` is static (a bucket), its contents are data.
    """
    x = embed_tokens(params, config, tokens)
    run_layer = layer_runner(config, positions, cache, page_table)
    for i, layer_params in enumerate(params["layers"]):
        x, cache = run_layer(i, layer_params, x, cache, kernels)
    return rms_norm(x, params["final_norm"], config.rms_norm_eps), cache


def output_logits(
    params: Params, config: ModelConfig, x: jax.Array, kernels: KernelConfig = XLA_KERNELS
) -> jax.Array:
    """Final-normed hidden states [..., hidden] -> float32 logits [..., vocab]."""
    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    logits = linear(x, head, kernels).astype(jnp.float32)
    if config.final_logit_softcap is not None:
        logits = config.final_logit_softcap * jnp.tanh(logits / config.final_logit_softcap)
    return logits


def forward(
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,  # [b, t] int32
    positions: jax.Array,  # [b, t] int32
    cache: KVCache,
    page_table: jax.Array,  # [b, pages] int32
    *,
    logits_index: jax.Array | None = None,  # [b] int32: compute logits only at tokens[:, index]
    kernels: KernelConfig = XLA_KERNELS,
) -> tuple[jax.Array, KVCache]:
    """Runs the model over new tokens (forward_hidden) and returns (logits, cache).

    logits: [b, t, vocab] float32, or [b, vocab] when `logits_index` is given.
    """
    x, cache = forward_hidden(params, config, tokens, positions, cache, page_table, kernels=kernels)
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [b, hidden]
    return output_logits(params, config, x, kernels), cache
