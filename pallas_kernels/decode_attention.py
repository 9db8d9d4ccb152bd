"""Decode attention: one new query token per slot against the whole preallocated KV cache.

Axis letters: L layers, B slots, N query heads, K kv heads, G = N // K query heads per kv head,
M cache positions (max_len), D head dim.

The kernel reads the cache in place: k_cache / v_cache are the full [L, B, K, M, D] arrays and the static
`layer` is chosen by the BlockSpec index map, so XLA never slices or copies a layer before the call.
One program handles one (slot, kv head, split) and all G query heads of that kv head together, so every
key block is loaded once per kv head (GQA/MQA without repeating K/V). It loops over the key blocks of its
split that hold valid keys of its slot (ragged `lengths`, sliding window); blocks past `lengths[b]` are
never loaded on GPU. Each split writes an unnormalised partial (output, log-sum-exp) and a small jnp
combine step merges the splits (split-K / flash-decoding).

Paged layout: the only place that turns a logical key block of a slot into cache rows is
`_key_block_rows`. A paged cache would pass a page table as one more scalar table, give K/V a BlockSpec
over a (layer, kv head)'s whole page pool, and look the physical page up there; the loop is unchanged.

TPU note: the kv BlockSpec covers a slot's `max_len_bucket` rows, which Mosaic copies to VMEM whole; a
TPU-tuned variant would move key blocks into the grid with scalar-prefetched index maps. GPU (Triton)
and interpret mode load only the visited blocks.
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
    largest_divisor_block,
    min_dot_rows,
    scalar_table_spec,
)

__all__ = ["BlockSizes", "decode_attention", "decode_attention_reference", "default_interpret"]

SUPPORTED_HEAD_DIMS = (64, 128, 256)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Key block size (a power of two dividing max_len_bucket // num_splits)."""

    block_k: int = 128

    def __post_init__(self):
        check_block("block_k", self.block_k)

    @classmethod
    def get_default(cls, split_len: int) -> BlockSizes:
        return cls(block_k=largest_divisor_block(split_len, preferred=128))


def _check_inputs(q, k_cache, v_cache, lengths, layer, sliding_window, logit_softcap, num_splits, bucket):
    if q.ndim != 3:
        raise ValueError(f"q must be [num_slots, num_heads, head_dim]; got {q.shape=}")
    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches must be equal [layers, slots, kv_heads, max_len, dim]: {k_cache.shape=} {v_cache.shape=}"
        )
    num_slots, num_heads, head_dim = q.shape
    num_layers, cache_slots, num_kv_heads, max_len, cache_dim = k_cache.shape
    if cache_slots != num_slots or cache_dim != head_dim:
        raise ValueError(f"q and cache disagree on slots or head_dim: {q.shape=} {k_cache.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{head_dim=} must be one of {SUPPORTED_HEAD_DIMS}")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"dtypes differ: {q.dtype=} {k_cache.dtype=} {v_cache.dtype=}")
    if lengths.shape != (num_slots,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(
            f"lengths must be an integer array of shape ({num_slots},); got {lengths.shape} {lengths.dtype}"
        )
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"{layer=} must be a static int in [0, {num_layers=})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be a positive int or None")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"{logit_softcap=} must be positive or None")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{num_splits=} must be a positive int")
    if not 0 < bucket <= max_len or bucket % num_splits:
        raise ValueError(f"max_len_bucket={bucket} must be in (0, {max_len=}], a multiple of {num_splits=}")


@functools.partial(
    jax.jit,
    static_argnames=[
        "layer",
        "sm_scale",
        "sliding_window",
        "logit_softcap",
        "block_sizes",
        "num_splits",
        "max_len_bucket",
        "interpret",
    ],
)
def decode_attention(
    q: jax.Array,  # [B, N, D]
    k_cache: jax.Array,  # [L, B, K, M, D]
    v_cache: jax.Array,  # [L, B, K, M, D]
    lengths: jax.Array,  # [B] int32, valid keys per slot (0 = inactive slot)
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    num_splits: int = 1,
    max_len_bucket: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, N, D], dtype of q
    """Attention of each slot's newest token (at position lengths[b] - 1) over its cached keys.

    Key j of slot b is visible iff j < lengths[b] and (sliding_window is None or
    j > lengths[b] - 1 - sliding_window). Inactive slots (lengths 0) return zeros.
    `max_len_bucket` (static, default max_len) bounds the keys the kernel may visit; the caller must keep
    lengths <= max_len_bucket. All keyword arguments are static: changing one recompiles.
    """
    bucket = k_cache.shape[3] if max_len_bucket is None else max_len_bucket
    _check_inputs(q, k_cache, v_cache, lengths, layer, sliding_window, logit_softcap, num_splits, bucket)
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    split_len = bucket // num_splits
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(split_len)
    block_k = block_sizes.block_k
    if split_len % block_k:
        raise ValueError(f"{block_k=} must divide max_len_bucket // num_splits = {split_len}")

    # [B, N, D] -> [B, K, G_pad, D]: query heads of one kv head are adjacent (h = kv_head * G + g).
    # The G rows are the M side of the q.k matmul, padded to what the backend's matmul needs (a few KiB).
    group_padded = max(min_dot_rows(), pl.next_power_of_2(group))
    q_grouped = q.reshape(num_slots, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))

    kernel = functools.partial(
        _decode_attention_kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        block_k=block_k,
        blocks_per_split=split_len // block_k,
        bucket=bucket,
    )

    def q_index_map(b, h, s):
        del s
        return b, h, 0, 0

    def kv_index_map(b, h, s):
        # The layer is selected here, so the pallas_call reads the whole cache array in place.
        del s
        return layer, b, h, 0, 0

    def partial_index_map(b, h, s):
        return b, h, s, 0, 0

    partial_out, partial_lse = pl.pallas_call(
        kernel,
        grid=(num_slots, num_kv_heads, num_splits),
        in_specs=[
            scalar_table_spec((num_slots,)),  # lengths
            pl.BlockSpec((None, None, group_padded, head_dim), q_index_map),
            pl.BlockSpec((None, None, None, bucket, head_dim), kv_index_map),
            pl.BlockSpec((None, None, None, bucket, head_dim), kv_index_map),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_padded, head_dim), partial_index_map),
            pl.BlockSpec((None, None, None, group_padded, 1), partial_index_map),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((num_slots, num_kv_heads, num_splits, group_padded, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_slots, num_kv_heads, num_splits, group_padded, 1), jnp.float32),
        ],
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(lengths.astype(jnp.int32), q_grouped, k_cache, v_cache)

    out = _combine_splits(partial_out, partial_lse)  # [B, K, G_pad, D]
    return out[:, :, :group].reshape(num_slots, num_heads, head_dim).astype(q.dtype)


def _key_block_rows(logical_block, block_k: int):
    """Rows of the kv ref that hold logical key block `logical_block` of the current slot.

    Contiguous layout: the ref is this slot's [max_len_bucket, D] rows, so the mapping is the identity.
    A paged layout changes only this function: `pl.ds(page_table_ref[slot, logical_block] * block_k, block_k)`
    into a ref over the page pool.
    """
    return pl.ds(pl.multiple_of(logical_block * block_k, block_k), block_k)


def _decode_attention_kernel(
    # inputs
    lengths_ref,  # [B] int32 (whole table)
    q_ref,  # [G_pad, D]
    k_ref,  # [bucket, D] this slot's keys for this kv head
    v_ref,  # [bucket, D]
    # outputs
    out_ref,  # [G_pad, D] f32, this split's normalised partial output
    lse_ref,  # [G_pad, 1] f32, this split's log-sum-exp (MASK_VALUE if it saw no key)
    *,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_k: int,
    blocks_per_split: int,
    bucket: int,
):
    b, split = pl.program_id(0), pl.program_id(2)
    length = jnp.minimum(lengths_ref[b], bucket)
    query_pos = length - 1

    # This split owns logical blocks [split * bps, (split + 1) * bps); visit only those with visible keys.
    lo = split * blocks_per_split
    hi = jnp.minimum(lo + blocks_per_split, cdiv_nonneg(length, block_k))
    if sliding_window is not None:
        lo = jnp.maximum(lo, div_nonneg(query_pos - sliding_window + 1, block_k))

    q = q_ref[...]  # [G_pad, D]
    group_padded, head_dim = q.shape

    def body(j, carry):
        row_max, denom, acc = carry  # [G_pad, 1], [G_pad, 1], [G_pad, D]
        rows = _key_block_rows(j, block_k)
        k = k_ref[rows, :]  # [block_k, D]
        v = v_ref[rows, :]  # [block_k, D]
        s = dot_nt(q, k) * sm_scale  # [G_pad, block_k]
        if logit_softcap is not None:
            s = logit_softcap * jnp.tanh(s / logit_softcap)
        k_pos = j * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # [1, block_k]
        visible = k_pos < length
        if sliding_window is not None:
            visible = visible & (k_pos > query_pos - sliding_window)
        s = jnp.where(visible, s, MASK_VALUE)
        max_new = jnp.maximum(row_max, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(row_max - max_new)
        p = jnp.where(visible, jnp.exp(s - max_new), 0.0)  # [G_pad, block_k]
        denom = alpha * denom + jnp.sum(p, axis=1, keepdims=True)
        return max_new, denom, alpha * acc + dot_nn(p.astype(v.dtype), v)

    init = (
        jnp.full((group_padded, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((group_padded, 1), jnp.float32),
        jnp.zeros((group_padded, head_dim), jnp.float32),
    )
    row_max, denom, acc = lax.fori_loop(lo, jnp.maximum(lo, hi), body, init)
    seen = denom > 0.0
    safe_denom = jnp.where(seen, denom, 1.0)
    out_ref[...] = acc / safe_denom
    lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_denom), MASK_VALUE)


def _combine_splits(
    partial_out: jax.Array,  # [B, K, splits, G_pad, D] f32, each split normalised on its own
    partial_lse: jax.Array,  # [B, K, splits, G_pad, 1] f32
) -> jax.Array:  # [B, K, G_pad, D] f32
    """Merge split-K partials by their log-sum-exp weights; splits that saw nothing have output 0."""
    if partial_out.shape[2] == 1:
        return partial_out[:, :, 0]
    lse_max = jnp.max(partial_lse, axis=2, keepdims=True)
    weights = jnp.exp(partial_lse - lse_max)  # [B, K, splits, G_pad, 1]
    return jnp.sum(weights * partial_out, axis=2) / jnp.sum(weights, axis=2)


def decode_attention_reference(
    q: jax.Array,  # [B, N, D]
    k_cache: jax.Array,  # [L, B, K, M, D]
    v_cache: jax.Array,  # [L, B, K, M, D]
    lengths: jax.Array,  # [B]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    block_sizes: BlockSizes | None = None,
    num_splits: int = 1,
    max_len_bucket: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, N, D]
    """Plain-jnp decode attention with the same semantics (slices the layer; f32 softmax)."""
    del block_sizes, interpret
    bucket = k_cache.shape[3] if max_len_bucket is None else max_len_bucket
    _check_inputs(q, k_cache, v_cache, lengths, layer, sliding_window, logit_softcap, num_splits, bucket)
    num_slots, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[layer, :, :, :bucket]  # [B, K, M, D]
    v = v_cache[layer, :, :, :bucket]
    qg = q.reshape(num_slots, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("bkgd,bkmd->bkgm", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    k_pos = jnp.arange(bucket)[None, :]  # [1, M]
    visible = k_pos < lengths[:, None]  # [B, M]
    if sliding_window is not None:
        visible = visible & (k_pos > lengths[:, None] - 1 - sliding_window)
    visible = visible[:, None, None, :]  # [B, 1, 1, M]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0.0, 1.0, denom)
    out = jnp.einsum("bkgm,bkmd->bkgd", p, v.astype(jnp.float32))  # [B, K, G, D]
    return out.reshape(num_slots, num_heads, head_dim).astype(q.dtype)
