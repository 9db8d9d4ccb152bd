"""Decode attention over the whole KV cache on x86 CPUs with AVX-512: a C++ XLA FFI kernel
(decode_attention.cc) and its plain-JAX reference.

Each (slot, KV head) reads its keys and values straight from the cache buffer (float32, or bfloat16
held as uint16 bit patterns, kv_cache.py), once for all the query heads sharing them and only up to the
slot's length, where XLA copies every layer's slice out of the cache and runs small YNNPACK dots
(kernel_dispatch.attention_xla). Lengths are data, not shapes: no attend-length buckets.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cpu_kernels.native_build import register_kernels

TARGETS = {"float32": "jaxinfer_decode_attention_f32", "uint16": "jaxinfer_decode_attention_bf16bits"}
CPU_FEATURES = ("avx512f",)
LANES = 16  # head_dim must be a multiple of this
_SOURCE = Path(__file__).with_suffix(".cc")


@functools.cache
def decode_attention_available() -> bool:
    """Whether this process can run the kernel (an x86-64 CPU with AVX-512F and a C++ compiler, see
    native_build.register_kernels). Builds and registers it once."""
    return register_kernels(_SOURCE, CPU_FEATURES, tuple(TARGETS.values()))


def supports(cache_storage_dtype, head_dim: int) -> bool:
    """Caches the kernel reads: float32 or bfloat16 bit patterns (uint16), head_dim a multiple of 16."""
    return jnp.dtype(cache_storage_dtype).name in TARGETS and head_dim % LANES == 0


def decode_attention_cpu(
    q: jax.Array,  # [rows, heads, d] float32: the new query of each of the first `rows` cache slots
    k_cache: jax.Array,  # [layers, slots, kv_heads, positions, d]: float32 or uint16 bfloat16 bits
    v_cache: jax.Array,
    lengths: jax.Array,  # [rows] int32: keys per slot incl. the new one; 0 for an inactive slot
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> jax.Array:
    """-> [rows, heads, d] float32; zeros for slots of length 0. Needs decode_attention_available()."""
    if not decode_attention_available():  # also registers the kernel, once per process
        raise RuntimeError(
            "the CPU decode-attention kernel needs an x86-64 CPU with AVX-512F and a C++ compiler"
        )
    call = jax.ffi.ffi_call(
        TARGETS[jnp.dtype(k_cache.dtype).name], jax.ShapeDtypeStruct(q.shape, jnp.float32)
    )
    return call(
        q.astype(jnp.float32), k_cache, v_cache, lengths.astype(jnp.int32), layer=np.int64(layer),
        window=np.int64(sliding_window or 0), scale=np.float32(scale), softcap=np.float32(softcap or 0.0),
    )  # fmt: skip


def decode_attention_cpu_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    *,
    layer: int,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> jax.Array:
    """The kernel's result in plain JAX (float32 throughout)."""

    def widen(cache: jax.Array) -> jax.Array:
        x = cache[layer]
        if x.dtype == jnp.uint16:
            x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
        return x.astype(jnp.float32)  # [slots, kv, s, d]

    slots, heads, d = q.shape
    keys, values = widen(k_cache)[:slots], widen(v_cache)[:slots]
    kv_heads, positions = keys.shape[1], keys.shape[2]
    qg = q.astype(jnp.float32).reshape(slots, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, keys) * scale
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    pos = jnp.arange(positions)[None, :]
    visible = pos < lengths[:, None]
    if sliding_window:
        visible &= pos >= lengths[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", weights, values).reshape(slots, heads, d)
    return jnp.where((lengths > 0)[:, None, None], out, 0.0)
