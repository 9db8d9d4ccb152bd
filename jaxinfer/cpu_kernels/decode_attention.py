"""Attention over the paged KV cache on x86-64 CPUs, one query per row: a C++ XLA FFI kernel
(decode_attention.cc) built for AVX-512 (16-lane float vectors) and for AVX2 + FMA (8 lanes), the fastest
variant this CPU runs chosen at run time (native_build.best_isa), and its plain-JAX reference. Decode
steps pass one row per sequence; prefill chunks and verification steps pass each of a sequence's new
tokens as a row of its own (queries_per_row), attending up to its own position: causal attention that
computes no masked-out product.

The pages: k_pages, v_pages [layers, kv_heads, num_pages, page_size, head_dim] (float32, bfloat16 held as
uint16 bit patterns, or int8 with a float32 scale per position, k_scale and v_scale [layers, kv_heads,
num_pages, page_size], kv_cache.py); key position t of row r sits at page page_table[r, t // page_size],
offset t % page_size. Each (row, KV head) reads its keys and values straight from the pages, once for all
the query heads sharing them and only up to the row's length, where XLA gathers every layer's pages out
of the pool and runs small YNNPACK dots. Lengths are data, not shapes: no attend-length buckets. Int8
pages are read as they are: a key's scale multiplies its score, a value's its softmax weight.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cpu_kernels.native_build import FLOAT_ISAS, NativeKernel

# The handlers per cache storage dtype; each ISA variant's is the symbol + isa.suffix.
SYMBOLS = {
    "float32": "jaxinfer_decode_attention_f32",
    "uint16": "jaxinfer_decode_attention_bf16bits",
    "int8": "jaxinfer_decode_attention_int8",
}
LANES = 16  # head_dim must be a multiple of this
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"), tuple(SYMBOLS.values()), "the CPU decode-attention kernel", FLOAT_ISAS
)


def decode_attention_available() -> bool:
    """Whether this process runs the kernel (KERNEL.available(): an x86-64 CPU with AVX2 or AVX-512, a C++
    compiler, JAXINFER_NATIVE_KERNELS not 0). Builds and registers it once."""
    return KERNEL.available()


def supports(cache_storage_dtype, head_dim: int) -> bool:
    """Caches the kernel reads: float32, bfloat16 bit patterns (uint16) or int8 (with scales), head_dim a
    multiple of 16."""
    return jnp.dtype(cache_storage_dtype).name in SYMBOLS and head_dim % LANES == 0


def _check_shapes(
    q, k_pages, v_pages, page_table, lengths, layer: int, k_scale, v_scale, queries_per_row: int
) -> None:
    want_scales = jnp.dtype(k_pages.dtype) == jnp.int8
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (s is not None) != want_scales or (s is not None and s.shape != k_pages.shape[:-1]):
            raise ValueError(
                f"int8 pages {k_pages.shape} take {name} [layers, kv_heads, pages, page_size] and other "
                f"pages none; got {k_pages.dtype} pages with {name} {None if s is None else s.shape}"
            )
    if q.ndim != 3 or k_pages.ndim != 5 or k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(
            "decode attention wants q [rows, heads, d] and k_pages, v_pages of one shape and dtype "
            f"[layers, kv_heads, pages, page_size, d]; got q {q.shape}, k_pages {k_pages.shape} "
            f"{k_pages.dtype}, v_pages {v_pages.shape} {v_pages.dtype}"
        )
    rows, heads, d = q.shape
    layers, kv_heads, pages, page_size, page_d = k_pages.shape
    if page_d != d or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q {q.shape} does not fit pages {k_pages.shape}: "
            "head_dim differs or kv_heads does not divide heads"
        )
    if (
        queries_per_row < 1
        or page_table.ndim != 2
        or page_table.shape[0] * queries_per_row != rows
        or lengths.shape != (rows,)
    ):
        raise ValueError(
            f"want page_table [rows / {queries_per_row=}, pages_per_row] and lengths [rows] for the "
            f"{rows} rows of q; got page_table {page_table.shape}, lengths {lengths.shape}"
        )
    if pages < 1 or page_size < 1 or not 0 <= layer < layers:
        raise ValueError(
            f"want pages >= 1, page_size >= 1 and 0 <= layer < {layers}; got {k_pages.shape}, {layer=}"
        )


def decode_attention_cpu(
    q: jax.Array,  # [rows, heads, d] float32: one query per row, at position lengths - 1
    k_pages: jax.Array,  # [layers, kv_heads, pages, page_size, d]: float32 or uint16 bfloat16 bits
    v_pages: jax.Array,
    page_table: jax.Array,  # [rows / queries_per_row, pages_per_row] int32: each sequence's pages
    lengths: jax.Array,  # [rows] int32: keys per row incl. its own; 0 for an inactive row
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    k_scale: jax.Array | None = None,  # int8 pages: [layers, kv_heads, pages, page_size] float32
    v_scale: jax.Array | None = None,
    queries_per_row: int = 1,
    isa: str | None = None,
) -> jax.Array:
    """-> [rows, heads, d] float32; zeros for rows of length 0. Row r reads the pages of table row
    r // queries_per_row: a prefill chunk or a verification step of Q queries per sequence is Q rows,
    each attending causally up to its own position, over one table row. Reads no page-table entry past
    a row's length, and no page slot past its last key; page ids are clamped into the pool. Lengths past
    pages_per_row * page_size are clamped to it. Needs supports(k_pages.dtype, d). Runs the chosen
    variant (KERNEL.chosen_isa(); needs decode_attention_available()), or the one named by `isa`
    ("avx512_vnni", "avx2"), which this CPU must support."""
    target = KERNEL.target(SYMBOLS[jnp.dtype(k_pages.dtype).name], isa)  # registers it on first use
    _check_shapes(q, k_pages, v_pages, page_table, lengths, layer, k_scale, v_scale, queries_per_row)
    if not supports(k_pages.dtype, q.shape[-1]):
        raise ValueError(
            f"the CPU decode-attention kernel reads float32, uint16 (bfloat16 bits) or int8 pages with "
            f"head_dim a multiple of {LANES}; got {k_pages.dtype}, head_dim {q.shape[-1]}"
        )
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    scales = () if k_scale is None else (k_scale.astype(jnp.float32), v_scale.astype(jnp.float32))
    return call(
        q.astype(jnp.float32), k_pages, v_pages, *scales, page_table.astype(jnp.int32),
        lengths.astype(jnp.int32), layer=np.int64(layer), window=np.int64(sliding_window or 0),
        scale=np.float32(scale), softcap=np.float32(softcap or 0.0),
        queries_per_row=np.int64(queries_per_row),
    )  # fmt: skip


def decode_attention_cpu_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    queries_per_row: int = 1,
) -> jax.Array:
    """The kernel's result in plain JAX (float32 throughout): gathers each row's pages into contiguous
    keys and values and masks everything past its length (garbage there, even NaN, does not leak)."""
    _check_shapes(q, k_pages, v_pages, page_table, lengths, layer, k_scale, v_scale, queries_per_row)
    page_table = jnp.repeat(page_table, queries_per_row, axis=0)
    rows, heads, d = q.shape
    kv_heads, pages, page_size = k_pages.shape[1:4]
    positions = page_table.shape[1] * page_size
    table = jnp.clip(page_table.astype(jnp.int32), 0, pages - 1)
    pos = jnp.arange(positions)[None, :]
    lengths = jnp.minimum(lengths.astype(jnp.int32), positions)
    visible = pos < lengths[:, None]  # [rows, positions]
    if sliding_window:
        visible &= pos >= lengths[:, None] - sliding_window

    def gather(pool: jax.Array, scales: jax.Array | None) -> jax.Array:  # -> [rows, kv, positions, d]
        x = pool[layer][:, table]  # [kv, rows, pages_per_row, page_size, d]
        if x.dtype == jnp.uint16:
            x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
        x = x.astype(jnp.float32)
        if scales is not None:
            x = x * scales[layer][:, table][..., None]
        x = x.reshape(kv_heads, rows, positions, d).transpose(1, 0, 2, 3)
        return jnp.where(visible[:, None, :, None], x, 0.0)

    keys, values = gather(k_pages, k_scale), gather(v_pages, v_scale)
    qg = q.astype(jnp.float32).reshape(rows, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, keys) * scale
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", weights, values).reshape(rows, heads, d)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)
