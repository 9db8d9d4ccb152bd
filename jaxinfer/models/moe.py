"""Mixture-of-Experts MLP building blocks (pure functions; every shape static, so they jit).

A sparse MoE MLP (Mixtral, Qwen3-MoE) routes each token to `experts_per_token` of `experts` gated MLPs:

    logits = x @ router.T                      float32 [tokens, experts]
    weights, experts = route(logits, k, ...)   softmax over all experts, top k, optionally renormalised
    out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t]), up_e(x[t])))   for e = experts[t, j]

`moe_mlp` computes only the chosen experts: the (token, slot) assignments are sorted by expert, the token
rows gathered in that order, and each projection is one grouped matmul over the sorted rows (group e =
the rows routed to expert e), so no token is dropped (no capacity limit) and no expert computes a row it
was not routed. `moe_mlp_reference` computes every expert for every token (the dense oracle).

Expert weights are stacked [experts, out, in] in the project's [out, in] convention (y = x @ w.T), as a
float array, an Int8Weight with q int8 [experts, out, in] and scale float32 [experts, out], or an
Int4Weight with packed uint8 [experts, out, in / 2] and scale and minimum float32 [experts, out, groups]
(weight_formats.py; the kernels read its packed bytes as they are). Gate and up
are two grouped matmuls by default; `up=None` takes `gate` as the fused gate_up [experts, 2 * inter,
hidden] that transformers stores (`experts.gate_up_proj`: gate rows first, then up), one grouped matmul
over both.

`grouped_matmul` runs `jax.lax.ragged_dot_general` on XLA (TPU, GPU, and CPU without the native kernel)
and the C++ kernel (cpu_kernels.grouped_matmul) with KernelConfig.matmul == "native" where it is
available: XLA:CPU expands ragged_dot into a dense masked product over every group and copies the whole
weight each call (~20x slower than a dense dot of the same active size at 32 rows, 8 experts), while the
kernel reads only the experts that received rows.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels.grouped_matmul import (
    grouped_matmul_available,
    grouped_matmul_cpu,
    grouped_matmul_cpu_reference,
    row_groups,
)
from jaxinfer.weight_formats import Int4Weight, Int8Weight, logical_shape

Activation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> h, e.g. silu(gate) * up

# lhs [rows, in] ragged along rows; rhs [experts, out, in] grouped along experts, contracting `in`.
_RAGGED_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def route(router_logits: jax.Array, experts_per_token: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """router_logits [tokens, experts] -> (weights float32 [tokens, k], experts int32 [tokens, k]).

    Softmax over all experts in float32, the top k (largest first), and with `normalize` the k weights
    divided by their sum: transformers' MixtralTopKRouter always does, Qwen3MoeTopKRouter with
    norm_topk_prob. The weights stay float32 (Mixtral's); Qwen3-MoE then rounds them to the activations'
    dtype, which moe_mlp's `weights_dtype` does."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, experts_per_token)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def _dequantize(w, dtype=jnp.float32) -> jax.Array:
    """A stacked expert weight [experts, out, in] (float, Int8Weight with scale [experts, out] or
    Int4Weight) as `dtype`, dequantised in float32 first."""
    if isinstance(w, Int8Weight):
        _int8_values(w)
        return w.dequantize(dtype)
    if isinstance(w, Int4Weight):
        return _int4_checked(w).dequantize(dtype)
    return w.astype(dtype)


def _int4_checked(w: Int4Weight) -> Int4Weight:
    if w.packed.ndim != 3:
        raise ValueError(f"stacked int4 expert weights need packed [experts, out, in / 2]: {w.packed.shape}")
    return w


def _int8_values(w: Int8Weight) -> jax.Array:
    if w.q is None or w.q.ndim != 3:
        raise ValueError("a stacked int8 expert weight needs q int8 [experts, out, in] (no packed-only form)")
    return w.q


def grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, kernels: KernelConfig) -> jax.Array:
    """x [rows, in] sorted by expert . w [experts, out, in] -> [rows, out] in x's dtype.

    Group g is rows sum(group_sizes[:g]) .. + group_sizes[g] (group_sizes int32 [experts]); rows past
    sum(group_sizes) come out as zeros. `w` is a float array, an Int8Weight (q [experts, out, in],
    scale [experts, out]) or an Int4Weight (packed [experts, out, in / 2], scale and minimum [experts,
    out, groups]). kernels.matmul == "native" with the kernel available: the C++ kernel (float32
    arithmetic, the weights dequantised in registers); otherwise lax.ragged_dot_general, int8 weights
    converted in the graph and scaled per row after the product (exact: the scale is per output channel of
    each row's expert), int4 weights dequantised to x's dtype in the graph first (the reference form: it
    materialises every expert's weight each call)."""
    if kernels.matmul == "native" and grouped_matmul_available():
        if isinstance(w, Int8Weight):
            y = grouped_matmul_cpu(x, _int8_values(w), w.scale, group_sizes)
        elif isinstance(w, Int4Weight):
            w = _int4_checked(w)
            y = grouped_matmul_cpu(x, w.packed, w.scale, group_sizes, minimum=w.minimum)
        else:
            y = grouped_matmul_cpu(x, w, None, group_sizes)
        return y.astype(x.dtype)
    int8 = isinstance(w, Int8Weight)
    operand = _int8_values(w) if int8 else _dequantize(w, x.dtype)
    y = jax.lax.ragged_dot_general(
        x, operand.astype(x.dtype), group_sizes.astype(jnp.int32), _RAGGED_DIMS,
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    if int8:
        # Rows past the groups are zero already; clip their group index to a real expert.
        groups = jnp.minimum(row_groups(group_sizes, x.shape[0]), group_sizes.shape[0] - 1)
        y = y * jnp.take(w.scale.astype(jnp.float32), groups, axis=0)
    return y.astype(x.dtype)


def grouped_matmul_reference(x: jax.Array, w, group_sizes: jax.Array) -> jax.Array:
    """The plain-JAX oracle of grouped_matmul: each row's expert from the group sizes, that expert's
    dequantised weight gathered per row, one einsum -> float32 [rows, out] (zeros past the groups)."""
    if isinstance(w, Int8Weight):
        return grouped_matmul_cpu_reference(x, _int8_values(w), w.scale, group_sizes)
    return grouped_matmul_cpu_reference(x, _dequantize(w), None, group_sizes)


def _gate_up(xs: jax.Array, gate, up, group_sizes: jax.Array, kernels: KernelConfig):
    if up is not None:
        return grouped_matmul(xs, gate, group_sizes, kernels), grouped_matmul(xs, up, group_sizes, kernels)
    gate_up = grouped_matmul(xs, gate, group_sizes, kernels)  # fused [.., 2 * inter]: gate, then up
    return jnp.split(gate_up, 2, axis=-1)


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    gate,
    up,
    down,
    *,
    experts_per_token: int,
    normalize: bool,
    activation: Activation,
    kernels: KernelConfig,
    weights_dtype=None,
) -> jax.Array:
    """A sparse MoE gated MLP: x [tokens, hidden] -> [tokens, hidden] in x's dtype.

    router: float [experts, hidden]; gate, up: [experts, inter, hidden] and down: [experts, hidden,
    inter], each a float array, an Int8Weight (q of that shape, scale [experts, out]) or an Int4Weight of
    that logical shape; up=None takes
    gate as the fused gate_up [experts, 2 * inter, hidden] (gate rows first, transformers' layout).
    activation(gate, up) -> h [.., inter], e.g. silu(gate) * up.
    weights_dtype: None keeps the routing weights float32 when mixing the experts' outputs (Mixtral);
    x.dtype rounds them to the activations' dtype first (Qwen3-MoE). Identical for float32 activations.

    The tokens * k assignments are sorted by expert (stable), the token rows gathered in that order, then
    three grouped matmuls (gate and up, down), each output row scaled by its routing weight and added back
    to its token (`.at[].add`). Every token keeps all k experts (no capacity limit)."""
    tokens, _ = x.shape
    experts = logical_shape(down)[0]
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32).T)  # [tokens, experts]
    weights, chosen = route(logits, experts_per_token, normalize)  # [tokens, k] each
    flat = chosen.reshape(-1)  # [tokens * k]: assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert, tokens ascending in each
    token_of = order // experts_per_token  # [tokens * k]
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)  # [experts]
    xs = jnp.take(x, token_of, axis=0)  # [tokens * k, hidden], sorted by expert
    g, u = _gate_up(xs, gate, up, group_sizes, kernels)
    h = activation(g, u).astype(x.dtype)  # [tokens * k, inter]
    y = grouped_matmul(h, down, group_sizes, kernels)  # [tokens * k, hidden]
    w = jnp.take(weights.reshape(-1), order)[:, None]  # float32 [tokens * k, 1]
    if weights_dtype is not None:
        w = w.astype(weights_dtype)
    contribution = (y * w).astype(x.dtype)  # as transformers: the product in the promoted dtype, then x's
    return jnp.zeros_like(x).at[token_of].add(contribution)


def moe_mlp_reference(
    x: jax.Array,
    router: jax.Array,
    gate,
    up,
    down,
    *,
    experts_per_token: int,
    normalize: bool,
    activation: Activation,
    weights_dtype=None,
) -> jax.Array:
    """The dense oracle of moe_mlp (same arguments, no kernels): every expert computed for every token
    in float32 (highest precision), mixed by the routing weights (zero for the experts not chosen).
    x [tokens, hidden] -> [tokens, hidden] in x's dtype."""
    tokens, _ = x.shape
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32).T, precision=hi)
    weights, chosen = route(logits, experts_per_token, normalize)
    if weights_dtype is not None:
        weights = weights.astype(weights_dtype).astype(jnp.float32)
    mix = jnp.zeros((tokens, logical_shape(down)[0]), jnp.float32)
    mix = mix.at[jnp.arange(tokens)[:, None], chosen].add(weights)  # [tokens, experts]
    xf = x.astype(jnp.float32)
    if up is None:
        g, u = jnp.split(jnp.einsum("th,eih->eti", xf, _dequantize(gate), precision=hi), 2, axis=-1)
    else:
        g = jnp.einsum("th,eih->eti", xf, _dequantize(gate), precision=hi)
        u = jnp.einsum("th,eih->eti", xf, _dequantize(up), precision=hi)
    h = activation(g, u)  # [experts, tokens, inter]
    y = jnp.einsum("eti,ehi->eth", h, _dequantize(down), precision=hi)
    return jnp.einsum("te,eth->th", mix, y, precision=hi).astype(x.dtype)
