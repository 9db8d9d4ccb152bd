"""Weight-only int4 matmul: y = x @ W.T, W given as 4-bit values with per-group scales and minimums.

Weight format (a linear weight W of logical shape [n (out), k (in)], stored [out, in]):
    packed   uint8 [n, k // 2]: byte j of row r holds q[r, 2j] in its low nibble and q[r, 2j + 1] in its high
             nibble, q in [0, 15]
    scale    float32 [n, k // group_size]
    minimum  float32 [n, k // group_size]
    W[r, c] = q[r, c] * scale[r, c // group_size] + minimum[r, c // group_size]; group_size is 32 or 128.

Shapes: x [m, k] activations (f32 / bf16); y [m, n] in x.dtype, accumulated in f32.

The packed weights are read from memory as bytes (half of int8, a quarter of bf16) and unpacked inside the
kernel. The wrapper splits x once into its even and odd columns, so that the low nibbles of a byte tile
contract with x[:, 0::2] and the high nibbles with x[:, 1::2]: no interleaving in the kernel. The 4-bit
values are exact in bf16, so the weights are not rounded to x's dtype; each group's scale and minimum are
applied to its f32 partial product (f32 operands are multiplied at full precision, not TF32):

    y = sum_g (x_g . q_g) * scale_g + (sum x_g) * minimum_g

so the kernel never builds a dequantised weight tile.

One program computes one [block_m, block_n] output tile and loops over the contraction axis inside the
kernel in steps of block_k (a grid axis cannot carry an accumulator on Triton); the groups of one step are
unrolled.
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
    pad_axis,
)

__all__ = [
    "GROUP_SIZES",
    "BlockSizes",
    "int4_matmul",
    "int4_matmul_reference",
]

GROUP_SIZES = (32, 128)


def _check_inputs(x, packed, scale, minimum, group_size) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{group_size=} must be one of {GROUP_SIZES}")
    if x.ndim != 2 or packed.ndim != 2:
        raise ValueError(f"x must be [m, k] and packed [n, k // 2]; got {x.shape=} {packed.shape=}")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"{x.dtype=} must be float32 or bfloat16")
    if packed.dtype != jnp.uint8:
        raise ValueError(f"{packed.dtype=} must be uint8 (two 4-bit values per byte)")
    n, k = packed.shape[0], x.shape[1]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"packed must be [n, k // 2] for {x.shape=}; got {packed.shape=}")
    if k % group_size:
        raise ValueError(f"k={k} must be a multiple of {group_size=}")
    for name, array in (("scale", scale), ("minimum", minimum)):
        if array.shape != (n, k // group_size):
            raise ValueError(
                f"{name} must be [n, k // group_size] = {(n, k // group_size)}; got {array.shape}"
            )
        if array.dtype != jnp.float32:
            raise ValueError(f"{name}.dtype={array.dtype} must be float32")


@functools.partial(jax.jit, static_argnames=["group_size", "block_sizes", "interpret"])
def int4_matmul(
    x: jax.Array,  # [m, k] f32 / bf16
    packed: jax.Array,  # [n, k // 2] uint8
    scale: jax.Array,  # [n, k // group_size] f32
    minimum: jax.Array,  # [n, k // group_size] f32
    *,
    group_size: int,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [m, n], x.dtype
    """x @ W.T with f32 accumulation; see the module docstring. group_size and block sizes are static."""
    _check_inputs(x, packed, scale, minimum, group_size)
    m, k = x.shape
    n = packed.shape[0]
    if block_sizes is None:
        block_sizes = BlockSizes.get_default(m, n, k)
    block_m, block_n, block_k = block_sizes.block_m, block_sizes.block_n, block_sizes.block_k
    if n % block_n:
        raise ValueError(f"{block_n=} must divide {n=} (weights are never padded: that would copy them)")
    if k % block_k or block_k % group_size:
        raise ValueError(f"{block_k=} must divide {k=} and be a multiple of {group_size=}")

    x_padded = pad_axis(x, 0, block_m)  # [m_padded, k]
    m_padded = x_padded.shape[0]
    x_even, x_odd = x_padded[:, 0::2], x_padded[:, 1::2]  # [m_padded, k // 2] each
    # One row per group (tiny): the kernel reads group g of its block_n columns as a [1, block_n] row.
    scale_rows, minimum_rows = scale.T, minimum.T  # [k // group_size, n]
    num_groups = k // group_size

    kernel = functools.partial(
        _int4_matmul_kernel, group_size=group_size, block_k=block_k, num_steps=k // block_k
    )
    y = pl.pallas_call(
        kernel,
        grid=(m_padded // block_m, n // block_n),
        in_specs=[
            pl.BlockSpec((block_m, k // 2), lambda i, j: (i, 0)),
            pl.BlockSpec((block_m, k // 2), lambda i, j: (i, 0)),
            pl.BlockSpec((block_n, k // 2), lambda i, j: (j, 0)),
            pl.BlockSpec((num_groups, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((num_groups, block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m_padded, n), x.dtype),
        compiler_params=compiler_params(num_warps=4, num_stages=3),
        cost_estimate=pl.CostEstimate(
            flops=2 * m * n * k,
            transcendentals=0,
            bytes_accessed=x.size * x.dtype.itemsize
            + packed.size
            + 2 * scale.size * 4
            + m * n * x.dtype.itemsize,
        ),
        interpret=interpret,
        name="int4_matmul",
    )(x_even, x_odd, packed, scale_rows, minimum_rows)
    return y[:m]


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [n, k].T in f32; f32 operands at full precision (Triton would otherwise use TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(
        a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )


def _int4_matmul_kernel(
    # inputs
    x_even_ref,  # [block_m, k // 2]: x[:, 0::2]
    x_odd_ref,  # [block_m, k // 2]: x[:, 1::2]
    packed_ref,  # [block_n, k // 2] uint8
    scale_ref,  # [k // group_size, block_n] f32
    minimum_ref,  # [k // group_size, block_n] f32
    # outputs
    y_ref,  # [block_m, block_n]
    *,
    group_size: int,
    block_k: int,
    num_steps: int,
):
    block_m, block_n = y_ref.shape
    half_group, groups_per_step = group_size // 2, block_k // group_size

    def body(i, acc):  # acc [block_m, block_n] f32
        for g in range(groups_per_step):
            start = pl.multiple_of(i * (block_k // 2) + g * half_group, half_group)
            cols = pl.ds(start, half_group)
            x_even = x_even_ref[:, cols]  # [block_m, half_group]
            x_odd = x_odd_ref[:, cols]
            # Unsigned 8-bit arithmetic is poorly supported on TPU; unpack in int32.
            byte = packed_ref[:, cols].astype(jnp.int32)  # [block_n, half_group]
            low = (byte & 15).astype(x_even.dtype)  # exact in bf16: 0..15
            high = (byte >> 4).astype(x_even.dtype)
            xq = _dot_nt(x_even, low) + _dot_nt(x_odd, high)  # [block_m, block_n]
            x_sum = jnp.sum(
                x_even.astype(jnp.float32) + x_odd.astype(jnp.float32), axis=1, keepdims=True
            )  # [block_m, 1]
            row = pl.ds(i * groups_per_step + g, 1)
            acc = acc + xq * scale_ref[row, :] + x_sum * minimum_ref[row, :]
        return acc

    acc = lax.fori_loop(0, num_steps, body, jnp.zeros((block_m, block_n), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _unpack(packed: jax.Array) -> jax.Array:
    """uint8 [n, k // 2] -> q int32 [n, k] in [0, 15]."""
    n, half = packed.shape
    byte = packed.astype(jnp.int32)
    return jnp.stack([byte & 15, byte >> 4], axis=-1).reshape(n, 2 * half)


def int4_matmul_reference(
    x: jax.Array,  # [m, k]
    packed: jax.Array,  # [n, k // 2] uint8
    scale: jax.Array,  # [n, k // group_size] f32
    minimum: jax.Array,  # [n, k // group_size] f32
    *,
    group_size: int,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:  # [m, n], x.dtype
    """Plain-jnp x @ W.T: unpack, dequantise to f32 [n, k], one f32 product at HIGHEST precision."""
    del block_sizes, interpret
    _check_inputs(x, packed, scale, minimum, group_size)
    n, k = packed.shape[0], x.shape[1]
    q = _unpack(packed).astype(jnp.float32).reshape(n, k // group_size, group_size)
    w = (q * scale[..., None] + minimum[..., None]).reshape(n, k)
    y = jnp.dot(x.astype(jnp.float32), w.T, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
