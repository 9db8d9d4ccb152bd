"""Weight-only int8 matmul: y = x @ dequant(w_q).T with symmetric per-channel or per-group scales.

Shapes: x [m, k] activations (f32 / bf16), w_q [n, k] int8 (weights stored [out, in]), scale [n] f32
(per output channel) or [n, k // group_size] f32 (per group). y [m, n] in x.dtype, accumulated in f32.

The int8 weights are read from memory once as int8 (the point: 2-4x fewer weight bytes than bf16/f32 in
memory-bound decode) and converted to x's dtype inside the kernel; int8 values are exact in bf16. Scales are
applied to the f32 partial products rather than to every weight: per channel once at the end, per group
once per group (`sum_g (x_g . w_g) * s_g`), so the kernel never builds a dequantised weight tile.

One program computes one [block_m, block_n] output tile and loops over the contraction axis inside the
kernel (a grid axis cannot carry an accumulator on Triton).

Also here: `quantize_int8` (weights) and `quantize_kv_int8` / `dequantize_int8` helpers (an int8 KV cache
with one scale per token and head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MatmulBlockSizes as BlockSizes,
)
from pallas_kernels._common import (
    compiler_params,
    default_interpret,
    dot_nt,
    pad_axis,
)

__all__ = [
    "BlockSizes",
    "default_interpret",
    "dequantize_int8",
    "dequantize_kv_int8",
    "int8_matmul",
    "int8_matmul_reference",
    "quantize_int8",
    "quantize_kv_int8",
]

INT8_MAX = 127


def _group_size(w_q: jax.Array, scale: jax.Array) -> int | None:
    """None for per-channel scales [n]; the group size for per-group scales [n, k // group_size]."""
    n, k = w_q.shape
    if scale.shape == (n,):
        return None
    if scale.ndim == 2 and scale.shape[0] == n and scale.shape[1] > 0 and k % scale.shape[1] == 0:
        return k // scale.shape[1]
    raise ValueError(f"scale must be [n] or [n, k // group_size] for {w_q.shape=}; got {scale.shape=}")


def _check_inputs(x, w_q, scale) -> int | None:
    if x.ndim != 2 or w_q.ndim != 2:
        raise ValueError(f"x must be [m, k] and w_q [n, k]; got {x.shape=} {w_q.shape=}")
    if x.shape[1] != w_q.shape[1]:
        raise ValueError(f"contraction dims differ: {x.shape=} {w_q.shape=}")
    if w_q.dtype != jnp.int8:
        raise ValueError(f"{w_q.dtype=} must be int8")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{x.dtype=} must be float32 or bfloat16")
    return _group_size(w_q, scale)


@functools.partial(jax.jit, static_argnames=["block_sizes", "interpret"])
def int8_matmul(
    x: jax.Array,  # [m, k] f32 / bf16
    w_q: jax.Array,  # [n, k] int8
    scale: jax.Array,  # [n] or [n, k // group_size] f32
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [m, n], x.dtype
    """x @ (w_q * scale).T with f32 accumulation; see the module docstring. Block sizes are static."""
    group_size = _check_inputs(x, w_q, scale)
    m, k = x.shape
    n = w_q.shape[0]
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(m, n, k)
    block_m, block_n, block_k = block_sizes.block_m, block_sizes.block_n, block_sizes.block_k
    if n % block_n:
        raise ValueError(f"{block_n=} must divide {n=} (weights are never padded: that would copy them)")
    if group_size is None:
        if k % block_k:
            raise ValueError(f"{block_k=} must divide {k=}")
        step = block_k
        scale_rows = scale.astype(jnp.float32).reshape(1, n)  # [1, n]
    else:
        step = group_size
        scale_rows = scale.astype(jnp.float32).T  # [k // group_size, n]: one row per group, tiny
    num_scale_rows = scale_rows.shape[0]

    x_padded = pad_axis(x, 0, block_m)  # [m_padded, k]
    m_padded = x_padded.shape[0]
    kernel = functools.partial(
        _int8_matmul_kernel, step=step, num_steps=k // step, per_group=group_size is not None
    )
    y = pl.pallas_call(
        kernel,
        grid=(m_padded // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
            pl.BlockSpec((block_n, k), lambda i, j: (j, 0)),
            pl.BlockSpec((num_scale_rows, block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_padded, n), x.dtype),
        compiler_params=compiler_params(num_warps=4, num_stages=3),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * n * k,
            transcendentals=0,
            bytes_accessed=x.size * x.dtype.itemsize + w_q.size + scale.size * 4 + m * n * x.dtype.itemsize,
        ),
        interpret=interpret,
        name="int8_matmul",
    )(x_padded, w_q, scale_rows)
    return y[:m]


def _int8_matmul_kernel(
    # inputs
    x_ref,  # [block_m, k]
    w_ref,  # [block_n, k] int8
    scale_ref,  # [1, block_n] (per channel) or [k // group_size, block_n] (per group) f32
    # outputs
    y_ref,  # [block_m, block_n]
    *,
    step: int,
    num_steps: int,
    per_group: bool,
):
    block_m, block_n = y_ref.shape

    def body(i, acc):  # acc [block_m, block_n] f32
        cols = pl.ds(pl.multiple_of(i * step, step), step)
        x = x_ref[:, cols]  # [block_m, step]
        w = w_ref[:, cols].astype(x.dtype)  # [block_n, step], exact: |w| <= 127
        xw = dot_nt(x, w)  # [block_m, block_n] f32
        if per_group:
            xw = xw * scale_ref[pl.ds(i, 1), :]  # group i's scales, [1, block_n]
        return acc + xw

    acc = lax.fori_loop(0, num_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    if not per_group:
        acc = acc * scale_ref[...]
    y_ref[...] = acc.astype(y_ref.dtype)


def int8_matmul_reference(
    x: jax.Array,  # [m, k]
    w_q: jax.Array,  # [n, k] int8
    scale: jax.Array,  # [n] or [n, k // group_size]
    *,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [m, n], x.dtype
    """Plain-jnp x @ dequant(w_q).T in f32."""
    del block_sizes, interpret
    _check_inputs(x, w_q, scale)
    y = jnp.dot(x.astype(jnp.float32), dequantize_int8(w_q, scale).T, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def quantize_int8(w: jax.Array, *, group_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantisation of weights w [n, k] (stored [out, in]).

    Returns (w_q [n, k] int8, scale f32): scale [n] = max|w[row]| / 127 per output channel, or
    [n, k // group_size] per group of `group_size` consecutive inputs. All-zero rows/groups get scale 1.
    """
    if w.ndim != 2:
        raise ValueError(f"w must be [n, k]; got {w.shape=}")
    n, k = w.shape
    if group_size is None:
        grouped = w.astype(jnp.float32).reshape(n, 1, k)
    else:
        if group_size < 1 or k % group_size:
            raise ValueError(f"{group_size=} must be a positive divisor of {k=}")
        grouped = w.astype(jnp.float32).reshape(n, k // group_size, group_size)
    amax = jnp.max(jnp.abs(grouped), axis=-1, keepdims=True)
    scale = jnp.where(amax == 0.0, 1.0, amax / INT8_MAX)
    w_q = jnp.clip(jnp.round(grouped / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8).reshape(n, k)
    scale = scale[..., 0]  # [n, groups]
    return w_q, (scale[:, 0] if group_size is None else scale)


def dequantize_int8(w_q: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize_int8`: f32 [n, k] from int8 [n, k] and scale [n] or [n, k // group_size]."""
    n, k = w_q.shape
    group_size = _group_size(w_q, scale)
    if group_size is None:
        return w_q.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    w = w_q.astype(jnp.float32).reshape(n, k // group_size, group_size) * scale.astype(jnp.float32)[..., None]
    return w.reshape(n, k)


def quantize_kv_int8(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 quantisation along `axis` (head_dim of a K/V tensor: one scale per token and head).

    x [..., D] -> (x_q int8 same shape, scale f32 with `axis` removed), x ~= x_q * expand_dims(scale, axis).
    """
    if x.ndim == 0:
        raise ValueError(f"x must have at least one axis; got {x.shape=}")
    axis = axis % x.ndim
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = jnp.where(amax == 0.0, 1.0, amax / INT8_MAX)
    x_q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return x_q, jnp.squeeze(scale, axis=axis)


def dequantize_kv_int8(x_q: jax.Array, scale: jax.Array, axis: int = -1, dtype=jnp.float32) -> jax.Array:
    """Inverse of `quantize_kv_int8`."""
    axis = axis % x_q.ndim
    return (x_q.astype(jnp.float32) * jnp.expand_dims(scale, axis)).astype(dtype)
