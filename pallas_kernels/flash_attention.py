"""Flash attention for prefill: blocked online softmax with causal / sliding-window / padding masks and GQA.

Axis letters: B batch, N query heads, K kv heads, G = N // K query heads per kv head, T query positions,
S key positions, D head dim.

One Pallas program handles one (batch, query head, query block). It streams over key blocks with an online
softmax (never materialising [T, S]) and only visits key blocks that can hold a visible key: blocks past
the causal frontier, past `kv_lengths[b]` or before the sliding window are skipped by the loop bounds.
Query head h reads kv head h // G straight from the K/V arrays through the index map (no repeat/copy).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MASK_VALUE,
    cdiv_nonneg,
    check_block,
    compiler_params,
    default_interpret,
    div_nonneg,
    dot_nn,
    dot_nt,
    pad_axis,
    scalar_table_spec,
)

__all__ = ["BlockSizes", "default_interpret", "flash_attention", "flash_attention_reference"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
# Smallest block the defaults shrink to for short sequences: a multiple of the TPU sublane count (8)
# and large enough for Triton's tl.dot (16).
MIN_DEFAULT_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query / key block sizes (powers of two). Frozen so it can be a static jit argument."""

    block_q: int = 128
    block_k: int = 128

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("block_k", self.block_k)

    @classmethod
    def get_default(cls, head_dim: int, q_len: int, kv_len: int) -> BlockSizes:
        # 256-wide heads: smaller tiles keep q, k, v and the accumulator inside GPU shared memory / VMEM.
        preferred = 64 if head_dim > 128 else 128
        return cls(
            block_q=min(preferred, max(MIN_DEFAULT_BLOCK, pl.next_power_of_2(q_len))),
            block_k=min(preferred, max(MIN_DEFAULT_BLOCK, pl.next_power_of_2(kv_len))),
        )


def _check_inputs(q, k, v, q_offsets, kv_lengths, sliding_window, logit_softcap) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, heads, len, dim]; got {q.shape=} {k.shape=} {v.shape=}")
    batch, num_heads, _, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape=} {v.shape=}")
    kv_batch, num_kv_heads, _, kv_head_dim = k.shape
    if kv_batch != batch or kv_head_dim != head_dim:
        raise ValueError(f"q and k disagree on batch or head_dim: {q.shape=} {k.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{head_dim=} must be one of {SUPPORTED_HEAD_DIMS}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype=} {k.dtype=} {v.dtype=}")
    for name, table in (("q_offsets", q_offsets), ("kv_lengths", kv_lengths)):
        if table.shape != (batch,) or not jnp.issubdtype(table.dtype, jnp.integer):
            raise ValueError(f"{name} must be int of shape ({batch},); got {table.shape} {table.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be a positive int or None")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"{logit_softcap=} must be positive or None")


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "causal", "sliding_window", "logit_softcap", "block_sizes", "interpret"],
)
def flash_attention(
    q: jax.Array,  # [B, N, T, D]
    k: jax.Array,  # [B, K, S, D]
    v: jax.Array,  # [B, K, S, D]
    *,
    q_offsets: jax.Array,  # [B] int32, absolute position of q[:, :, 0]
    kv_lengths: jax.Array,  # [B] int32, keys at index >= kv_lengths[b] are padding
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, N, T, D], dtype of q
    """Masked multi-head attention over a chunk of queries; see the module docstring.

    Query at absolute position p = q_offsets[b] + t sees key j iff j < kv_lengths[b], (not causal or j <= p)
    and (sliding_window is None or j > p - sliding_window). Logits are `sm_scale * q.k`, soft-capped as
    `cap * tanh(s / cap)` before masking. Rows that see no key return zeros. Every keyword argument except
    q_offsets / kv_lengths is static: changing it recompiles.
    """
    _check_inputs(q, k, v, q_offsets, kv_lengths, sliding_window, logit_softcap)
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(head_dim, q_len, kv_len)
    block_q, block_k = block_sizes.block_q, block_sizes.block_k

    # Ragged tails: pad to whole blocks; padded keys are masked by kv_lengths, padded queries sliced off.
    q = pad_axis(q, 2, block_q)
    k = pad_axis(k, 2, block_k)
    v = pad_axis(v, 2, block_k)
    q_len_padded, kv_len_padded = q.shape[2], k.shape[2]

    kernel = functools.partial(
        _flash_attention_kernel,
        sm_scale=sm_scale,
        causal=causal,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        block_q=block_q,
        block_k=block_k,
        num_kv_blocks=kv_len_padded // block_k,
    )

    def q_index_map(b, h, qi):
        return b, h, qi, 0

    def kv_index_map(b, h, qi):
        del qi
        return b, div_nonneg(h, group), 0, 0

    grid = (batch, num_heads, q_len_padded // block_q)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            scalar_table_spec((batch,)),  # q_offsets
            scalar_table_spec((batch,)),  # kv_lengths
            pl.BlockSpec((None, None, block_q, head_dim), q_index_map),
            pl.BlockSpec((None, None, kv_len_padded, head_dim), kv_index_map),
            pl.BlockSpec((None, None, kv_len_padded, head_dim), kv_index_map),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, head_dim), q_index_map),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
        cost_estimate=pl.CostEstimate(
            flops=4 * batch * num_heads * q_len * kv_len * head_dim,
            transcendentals=batch * num_heads * q_len * kv_len,
            bytes_accessed=(2 * q.size + k.size + v.size) * q.dtype.itemsize,
        ),
        interpret=interpret,
        name="flash_attention",
    )(q_offsets.astype(jnp.int32), kv_lengths.astype(jnp.int32), q, k, v)
    return out[:, :, :q_len]


def _flash_attention_kernel(
    # inputs
    q_offsets_ref,  # [B] int32 (whole table)
    kv_lengths_ref,  # [B] int32 (whole table)
    q_ref,  # [block_q, D]
    k_ref,  # [S_padded, D]
    v_ref,  # [S_padded, D]
    # outputs
    o_ref,  # [block_q, D]
    *,
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_q: int,
    block_k: int,
    num_kv_blocks: int,
):
    b, qi = pl.program_id(0), pl.program_id(2)
    kv_length = kv_lengths_ref[b]
    first_pos = q_offsets_ref[b] + qi * block_q  # absolute position of this block's first query
    last_pos = first_pos + block_q - 1

    # Key blocks [lo, hi) hold every key some query of this block may see; the rest are never loaded.
    kv_end = jnp.minimum(kv_length, last_pos + 1) if causal else kv_length
    hi = jnp.minimum(cdiv_nonneg(kv_end, block_k), num_kv_blocks)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = jnp.minimum(div_nonneg(first_pos - sliding_window + 1, block_k), hi)

    q = q_ref[...]  # [block_q, D]
    q_pos = first_pos + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)  # [block_q, 1]

    def body(j, carry):
        row_max, denom, acc = carry  # [block_q, 1], [block_q, 1], [block_q, D]
        start = pl.multiple_of(j * block_k, block_k)
        k = k_ref[pl.ds(start, block_k), :]  # [block_k, D]
        v = v_ref[pl.ds(start, block_k), :]  # [block_k, D]
        s = dot_nt(q, k) * sm_scale  # [block_q, block_k]
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        k_pos = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        visible = k_pos < kv_length
        if causal:
            visible = visible & (k_pos <= q_pos)
        if sliding_window is not None:
            visible = visible & (k_pos > q_pos - sliding_window)
        s = jnp.where(visible, s, MASK_VALUE)
        max_new = jnp.maximum(row_max, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(row_max - max_new)
        # Explicit zero for hidden keys: a row with nothing visible yet has s == max_new == MASK_VALUE.
        p = jnp.where(visible, jnp.exp(s - max_new), 0.0)  # [block_q, block_k]
        denom = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
        return max_new, denom, alpha * acc + dot_nn(p.astype(v.dtype), v)

    head_dim = q.shape[-1]
    init = (
        jnp.full((block_q, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros((block_q, head_dim), jnp.float32),
    )
    _, denom, acc = lax.fori_loop(lo, hi, body, init)
    # Rows that saw no key (padding queries) have l == 0 and acc == 0: emit zeros, not 0/0.
    o_ref[...] = (acc / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def flash_attention_reference(
    q: jax.Array,  # [B, N, T, D]
    k: jax.Array,  # [B, K, S, D]
    v: jax.Array,  # [B, K, S, D]
    *,
    q_offsets: jax.Array,  # [B]
    kv_lengths: jax.Array,  # [B]
    sm_scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, N, T, D]
    """Plain-jnp attention with the same semantics (materialises [T, S]; f32 softmax)."""
    del block_sizes, interpret
    _check_inputs(q, k, v, q_offsets, kv_lengths, sliding_window, logit_softcap)
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, q_len, head_dim)
    s = jnp.einsum("bkgtd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    q_pos = q_offsets[:, None, None] + jnp.arange(q_len)[None, :, None]  # [B, T, 1]
    k_pos = jnp.arange(kv_len)[None, None, :]  # [1, 1, S]
    visible = k_pos < kv_lengths[:, None, None]  # [B, T, S]
    if causal:
        visible = visible & (k_pos <= q_pos)
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    visible = visible[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("bkgts,bksd->bkgtd", p, v.astype(jnp.float32))  # [B, K, G, T, D]
    return out.reshape(batch, num_heads, q_len, head_dim).astype(q.dtype)
