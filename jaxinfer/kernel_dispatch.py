"""The model's two hot operations, linear layers and attention, routed to an XLA or a Pallas implementation.

All choices are made at trace time from static facts (KernelConfig, the number of rows, the weight's
type), so the compiled step contains exactly one form of each operation.

A linear weight is a float array [out, in] or one of weight_formats' types (Int8Weight, Int4Weight,
PackedInt4Weight): the weight's type picks the family of kernels, KernelConfig and the number of rows
pick among them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import (
    decode_attention_cpu,
    decode_attention_supports,
    int4_matmul_cpu,
    int8_matmul_vnni,
)
from jaxinfer.weight_formats import (
    Int4Weight,
    Int5Weight,
    Int8Weight,
    LayerOf,
    PackedInt4Weight,
    PackedInt5Weight,
)
from pallas_kernels import int4_matmul, int8_matmul, quantize_int8
from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

MASK_VALUE = -1e30  # finite: a fully masked row gives a uniform softmax, not NaN


# Without the VNNI kernel, up to this many rows an int8 product runs as one matrix-vector product per
# row: each reads the int8 weights at ~28 GB/s, which beats the bf16 copy's dot up to 4 rows (SmolLM2
# decode step, 2 rows: 15.2 vs 23.9 ms; 4 rows: 21.3 vs 27.6; 8 rows: 37.5 vs 33.5). The VNNI kernel
# reads the weights once for all rows and takes over from 2 rows (SmolLM2 2 / 4 streams: 131 -> 200 /
# 202 -> 296 tokens/s); at one row the matrix-vector product stays faster (126-142 vs 109 tokens/s).
ROWS_AS_VECTORS = 4


def _dot_nt(x: jax.Array, w: jax.Array, out_type=None) -> jax.Array:
    """x [..., in] . w [out, in] -> [..., out], contracting the last dims directly."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_type)


def linear(x: jax.Array, w, kernels: KernelConfig) -> jax.Array:
    """x: [..., in]; w: [out, in] float array or a weight_formats type -> [..., out] in x's dtype.

    The spelling of each form matters on XLA:CPU (measured on a 20-layer SmolLM2-shaped MLP chain):
    `x @ w.T` beats the equivalent last-dim dot_general 2x at one row; the int8 weight converted after
    the transpose fuses into the matrix-vector product (~1.6x faster than float), while the same
    conversion under dot_general runs ~50x slower. At several rows that int8 form collapses (0.7 GB/s of
    weights against ~28 at one row); a bf16 copy (quantization.add_bf16_copies, past ROWS_AS_VECTORS
    rows) or int8 activations take over. With native kernels the VNNI kernel serves every row count
    (quantization.add_vnni_weights).
    4-bit weights have no fast XLA form on CPU: the native int4 kernel serves every row count there
    (PackedInt4Weight), the Pallas kernel on TPU/GPU. 5-bit weights (a GGUF file's Q5 blocks) have the
    native kernel on CPU (PackedInt5Weight); the runtime gives other kernels int8 instead
    (quantization.int5_as_int8), and an Int5Weight passed here takes XLA's product over its values.
    """
    if isinstance(w, LayerOf):  # a layer of a stacked native weight (layer_stack.py)
        y = _native_layer_linear(x.reshape(-1, x.shape[-1]), w)
    elif isinstance(w, Int8Weight):
        y = _int8_linear(x.reshape(-1, x.shape[-1]), w, kernels)
    elif isinstance(w, (PackedInt4Weight, PackedInt5Weight)):
        y = int4_matmul_cpu(x.reshape(-1, x.shape[-1]), w)
    elif isinstance(w, Int4Weight):
        y = _int4_linear(x.reshape(-1, x.shape[-1]), w, kernels)
    elif isinstance(w, Int5Weight):
        y = x.reshape(-1, x.shape[-1]) @ w.dequantize(x.dtype).T
    else:
        return x @ w.astype(x.dtype).T
    return y.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype)


def _native_layer_linear(x2: jax.Array, w: LayerOf) -> jax.Array:
    """x2 [rows, in] . layer w.layer of a stacked native weight -> [rows, out]."""
    if isinstance(w.weight, Int8Weight):
        return int8_matmul_vnni(x2, w.weight.vnni, w.weight.scale, layer=w.layer)
    return int4_matmul_cpu(x2, w.weight, layer=w.layer)


def _vnni_serves(w: Int8Weight, kernels: KernelConfig) -> bool:
    """Whether the native VNNI kernel takes this int8 weight's products (at every row count)."""
    return kernels.matmul == "native" and w.vnni is not None


def _int8_linear(x2: jax.Array, w: Int8Weight, kernels: KernelConfig) -> jax.Array:
    """x2 [rows, in] . Int8Weight -> [rows, out]."""
    rows, scale = x2.shape[0], w.scale
    if _vnni_serves(w, kernels):
        return int8_matmul_vnni(x2, w.vnni, scale)
    q = w.q if w.q is not None else w.rows(jnp.arange(w.shape[0]))  # only the packed form is held
    if kernels.matmul == "pallas":
        return int8_matmul(x2, q, scale, interpret=kernels.interpret)
    if rows > 1 and kernels.int8_activations:
        return _int8_activation_linear(x2, q, scale)
    if rows <= ROWS_AS_VECTORS:
        # One matrix-vector product per row: XLA fuses the int8 -> float conversion into each (memory bound).
        return jnp.concatenate([_weight_only(x2[i : i + 1], q, scale) for i in range(rows)])
    if w.bf16 is not None:
        return _dot_nt(x2.astype(jnp.bfloat16), w.bf16, out_type=jnp.float32)
    return _weight_only(x2, q, scale)  # the slow form at several rows, for lack of a bf16 copy


def weight_read_bytes(w, rows: int, kernels: KernelConfig) -> int:
    """Bytes `linear` reads from w for a product of `rows` rows: the form _int8_linear picks for an
    Int8Weight, every array of the other formats (for decode-step rooflines in the benchmarks)."""
    if isinstance(w, LayerOf):  # the native kernels read every array of their layer
        return w.nbytes
    if isinstance(w, Int8Weight):
        if _vnni_serves(w, kernels):
            return w.vnni.nbytes + w.scale.nbytes
        bf16_rows = kernels.matmul != "pallas" and not kernels.int8_activations and rows > ROWS_AS_VECTORS
        if bf16_rows and w.bf16 is not None:
            return w.bf16.nbytes
        return (w.q if w.q is not None else w.vnni).nbytes + w.scale.nbytes
    return sum(a.nbytes for a in jax.tree.leaves(w))


def _int4_linear(x2: jax.Array, w: Int4Weight, kernels: KernelConfig) -> jax.Array:
    """x2 [rows, in] . Int4Weight -> [rows, out]: the Pallas kernel, or XLA over the dequantised weight
    (the reference form; on CPU the native kernel serves PackedInt4Weight instead)."""
    if kernels.matmul == "pallas":
        return int4_matmul(
            x2, w.packed, w.scale, w.minimum, group_size=w.group_size, interpret=kernels.interpret
        )
    return x2 @ w.dequantize(x2.dtype).T


def _weight_only(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [rows, in] . int8 q [out, in] with per-output-channel scales -> [rows, out]."""
    return (x @ q.T.astype(x.dtype)) * scale.astype(x.dtype)


OUTLIER_CHANNELS = 8  # input channels per int8-activation matmul kept in float (LLM.int8()-style)


def _int8_activation_linear(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x [rows, in] -> [rows, out] float32: an int8 x int8 -> int32 dot with dynamic per-row activation
    scales, plus the few input channels with the largest activations (chosen per call, across its rows)
    multiplied in float.

    LLM activations carry a handful of outlier channels (SmolLM2: 0-7 per layer above |6|); a per-row
    int8 scale set by them crushes every other channel of the row, which changed SmolLM2's answers.
    Taking the top OUTLIER_CHANNELS channels out costs a [rows, 8] x [8, out] product.
    """
    x2 = x.astype(jnp.float32)  # [rows, in]
    _, outliers = jax.lax.top_k(jnp.max(jnp.abs(x2), axis=0), OUTLIER_CHANNELS)  # [k]
    x_out = jnp.take(x2, outliers, axis=1)  # [rows, k]
    x_in = x2.at[:, outliers].set(0.0)
    x_q, x_scale = quantize_int8(x_in)  # per row, like the weights' per output channel
    acc = _dot_nt(x_q, q, out_type=jnp.int32).astype(jnp.float32) * x_scale[:, None]  # [rows, out]
    w_out = jnp.take(q, outliers, axis=1).astype(jnp.float32)  # [out, k]
    return (acc + x_out @ w_out.T) * scale


def embed(table, tokens: jax.Array, dtype) -> jax.Array:
    """Rows of the embedding table [vocab, hidden] (float, Int8Weight or Int4Weight) for tokens [...]
    -> [..., hidden]: only the looked-up rows are dequantised."""
    if isinstance(table, Int8Weight):
        rows = table.rows(tokens).astype(jnp.float32)
        return (rows * jnp.take(table.scale, tokens, axis=0)[..., None]).astype(dtype)
    if isinstance(table, Int4Weight):
        flat = tokens.reshape(-1)
        picked = Int4Weight(*(jnp.take(a, flat, axis=0) for a in (table.packed, table.scale, table.minimum)),
                            table.group_size)  # fmt: skip
        return picked.dequantize(dtype).reshape(*tokens.shape, table.shape[1])
    return jnp.take(table, tokens, axis=0).astype(dtype)


def attention_bias(q_positions: jax.Array, key_len: int, sliding_window: int | None) -> jax.Array:
    """[b, t, key_len] float32: 0 where key j is visible to the query at position p (j <= p, and
    j > p - sliding_window), MASK_VALUE elsewhere. Built once per step and shared by every layer of a
    kind: an additive bias keeps XLA:CPU's attention fusions intact, where a per-layer `where` on the
    scores made decode attention ~6x slower."""
    key_pos = jnp.arange(key_len, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= q_positions[:, :, None]
    if sliding_window is not None:
        visible &= key_pos[None, None, :] > q_positions[:, :, None] - sliding_window
    return jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)


def attention_xla(
    q: jax.Array,  # [b, t, h, d]
    k: jax.Array,  # [kv, b, s, d], as KVCache.read gathers them
    v: jax.Array,  # [kv, b, s, d]
    bias: jax.Array,  # [b, t, s], from attention_bias
    *,
    scale: float,
    softcap: float | None,
) -> jax.Array:
    """GQA attention in plain XLA. Returns [b, t, h, d] in q's dtype.

    k, v may be narrower than q (a bfloat16 cache under float32 activations). Decode of more than
    ROWS_AS_VECTORS rows then multiplies in the cache's dtype, rounding the query as llama.cpp does with
    its f16 cache, so the cache slice is never widened (a sixth of a SmolLM2 step at 16 rows); below
    that, and in prefill, float32 products are as fast and exact.
    """
    b, t, h, d = q.shape
    num_kv = k.shape[0]
    out_dtype = q.dtype
    narrow = t == 1 and b > ROWS_AS_VECTORS and k.dtype.itemsize < q.dtype.itemsize
    q, k, v = (a.astype(k.dtype if narrow else q.dtype) for a in (q, k, v))
    if t == 1:  # decode: a 4-d form without the unit axis lowers to much faster dots on XLA:CPU
        qg = q.reshape(b, num_kv, h // num_kv, d)
        # Keys as the left operand ([s, d] x [d, g]): XLA:CPU's YNNPACK dot then packs the small query
        # block, not the keys (less than half the time per layer, SmolLM2 at 256 positions).
        scores = jnp.einsum("kbsd,bkgd->bksg", k, qg, preferred_element_type=jnp.float32)
        scores = jnp.swapaxes(scores, -1, -2) * scale
        bias = bias[:, None]  # [b, 1, 1, s]
    else:
        qg = q.reshape(b, t, num_kv, h // num_kv, d)
        scores = jnp.einsum("btkgd,kbsd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        bias = bias[:, None, None]  # [b, 1, 1, t, s]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = scores + bias
    # Normalise after the value product: one divide over [.., d] instead of over [.., s], and the divide
    # (which XLA:CPU keeps out of the next fusion) hands the output projection a flat [b, t, h*d] buffer.
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    denom = jnp.sum(weights, axis=-1, keepdims=True)  # [b, k, g, 1] or [b, k, g, t, 1]
    if t == 1:
        out = jnp.einsum("bkgs,kbsd->bkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    else:
        out = jnp.einsum("bkgts,kbsd->btkgd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        denom = jnp.moveaxis(denom, 3, 1)  # [b, t, k, g, 1]
    denom = jnp.broadcast_to(denom.reshape(b, t, h, 1), (b, t, h, d)).reshape(b, t, h * d)
    return (out.reshape(b, t, h * d) / denom).astype(out_dtype).reshape(b, t, h, d)


def prefill_attention_pallas(
    q: jax.Array,  # [b, t, h, d], the chunk's queries
    cache,  # KVCache already holding the chunk's keys and values
    page_table: jax.Array,  # [b, pages]
    q_start: jax.Array,  # [b]: absolute position of q[:, 0]
    kv_lens: jax.Array,  # [b]: valid keys per row (q_start + the chunk's true length)
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    interpret: bool,
) -> jax.Array:
    """The Pallas paged prefill kernel: the chunk's queries over the row's cached pages (its own keys
    included), read through the page table inside the kernel."""
    k_pages, v_pages = cache.arrays()
    return paged_prefill_attention(
        q, k_pages, v_pages, q_start.astype(jnp.int32), kv_lens.astype(jnp.int32), page_table,
        layer=layer, sm_scale=scale, sliding_window=sliding_window, logit_softcap=softcap,
        k_scale=cache.k_scale, v_scale=cache.v_scale, interpret=interpret,
    )  # fmt: skip


def decode_attention_pallas(
    q: jax.Array,  # [rows, 1, h, d]
    cache,  # KVCache holding this step's keys and values
    page_table: jax.Array,  # [rows, pages]
    lengths: jax.Array,  # [rows]: keys per row incl. the new token; 0 for rows without a request
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    interpret: bool,
) -> jax.Array:
    """The Pallas paged decode kernel reads the layer's pages in place (no XLA gather)."""
    k_pages, v_pages = cache.arrays()
    out = paged_decode_attention(
        q[:, 0], k_pages, v_pages, lengths, page_table, layer=layer, sm_scale=scale,
        sliding_window=sliding_window, logit_softcap=softcap, k_scale=cache.k_scale,
        v_scale=cache.v_scale, interpret=interpret,
    )  # fmt: skip
    return out[:, None]


def _native_at_one_row(w, kernels: KernelConfig) -> bool:
    return isinstance(w, (PackedInt4Weight, PackedInt5Weight)) or (
        isinstance(w, Int8Weight) and _vnni_serves(w, kernels)
    )


def native_attention_min_rows(layers: list[dict], kernels: KernelConfig) -> int:
    """Fewest decode rows that attend through the native kernel (KernelConfig.native_attention_min_rows).

    After a custom call XLA:CPU's next matrix-vector product (split over both threads) runs ~4x slower,
    a third more per SmolLM2 int8 step, so where an XLA product follows attention a one-row step keeps
    XLA attention; from 2 rows the kernel wins (SmolLM2 at 4 streams: 1.35x). Where every layer's
    output projection is a native product at one row too (int4, or int8 in its VNNI form), no XLA
    product follows and the kernel saves one row its page gathers (SmolLM2 / Gemma 3 int4 at one
    stream, AVX2: ~13% less per step).
    """
    native = all(_native_at_one_row(layer.get("o_proj"), kernels) for layer in layers)
    return 1 if kernels.matmul == "native" and native else kernels.native_attention_min_rows


# Most tokens a verification step takes per row: the last token and up to 7 drafts.
MAX_QUERIES_AS_ROWS = 8


def native_attention(kernels: KernelConfig, cache, head_dim: int, rows: int) -> bool:
    """Whether a step of `rows` query rows (rows x new tokens per row) attends through the C++ kernel:
    attention "native", at least `kernels.native_attention_min_rows` rows and pages the kernel reads
    (float32, bfloat16 bit patterns, or int8 with their scales)."""
    return (
        kernels.attention == "native"
        and rows >= kernels.native_attention_min_rows
        and decode_attention_supports(cache.k.dtype, head_dim)
    )


def attention_native(
    q: jax.Array,  # [b, t, h, d]: t new tokens per row (decode 1, verification k + 1, prefill a chunk)
    cache,  # KVCache holding this step's keys and values
    page_table: jax.Array,  # [b, pages]
    positions: jax.Array,  # [b, t]: each token's position; -1 for padding and rows without a request
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> jax.Array:
    """The C++ kernel reads the layer's pages straight out of the cache's storage (no XLA gather): each
    token is a query row of its own, attending causally up to its own position over its row's pages,
    so no step needs a page bucket and a prefill chunk does none of the masked-out products of the
    XLA form's [t, pages * page_size] scores (Gemma 3, a 512-token chunk: ~3x faster). -> [b, t, h, d]."""
    b, t, h, d = q.shape
    out = decode_attention_cpu(
        q.reshape(b * t, h, d), cache.k, cache.v, page_table, positions.reshape(-1) + 1, layer=layer,
        scale=scale, sliding_window=sliding_window, softcap=softcap, k_scale=cache.k_scale,
        v_scale=cache.v_scale, queries_per_row=t,
    )  # fmt: skip
    return out.reshape(b, t, h, d).astype(q.dtype)
