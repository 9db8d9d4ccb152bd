"""Grouped (ragged) matmul for Mixture-of-Experts layers on x86-64 CPUs: a C++ XLA FFI kernel
(grouped_matmul.cc) built for AVX-512 and for AVX2, the fastest variant this CPU runs chosen at run time.

    y[r, o] = sum_i x[r, i] * W[g(r), o, i]

for rows x [rows, in] sorted by group (group g owns rows sum(group_sizes[:g]) .. + group_sizes[g]; rows
past sum(group_sizes) come out as zeros, as `jax.lax.ragged_dot`'s) and stacked expert weights W
[experts, out, in]: float32, int8 with a float32 scale [experts, out] per output channel, or int4 in
weight_formats.Int4Weight's own layout (packed uint8 [experts, out, in / 2], float32 scale and minimum
[experts, out, in / group] per group of 32 or 128 inputs, w = q * scale + minimum), each dequantised in
registers; the arithmetic is float32 throughout (the activations are not quantised).

XLA:CPU expands `lax.ragged_dot` into a dense masked product over every group and copies the whole weight
on each call (~20x slower than a dense dot of the same active size at 32 rows, 8 experts). The kernel
reads only the experts that hold rows, each weight row once for all of its group's rows.
`grouped_matmul_cpu_reference` is the same product in plain JAX.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.cpu_kernels.native_build import FLOAT_ISAS, NativeKernel
from jaxinfer.weight_formats import Int4Weight, Int8Weight

SYMBOL_F32 = "jaxinfer_grouped_matmul_f32"  # float32 weights; each ISA variant: SYMBOL + isa.suffix
SYMBOL_INT8 = "jaxinfer_grouped_matmul_int8"  # int8 weights with per-output scales
SYMBOL_INT4 = "jaxinfer_grouped_matmul_int4"  # int4 weights with per-group scales and minimums
KERNEL = NativeKernel(
    Path(__file__).with_suffix(".cc"),
    (SYMBOL_F32, SYMBOL_INT8, SYMBOL_INT4),
    "the native grouped matmul kernel",
    FLOAT_ISAS,
)
INT4_MIN_GROUP = 32  # the kernel's int4 groups: a power of two of inputs from this one (32, 128, ...)


def grouped_matmul_available(isa: str | None = None) -> bool:
    """Whether this process runs the kernel (the chosen variant, or `isa`'s): an x86-64 CPU with AVX2 or
    AVX-512, a C++ compiler, JAXINFER_NATIVE_KERNELS not 0. Builds and registers it once."""
    return KERNEL.available(isa)


def grouped_matmul_cpu(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None,
    group_sizes: jax.Array,
    *,
    minimum: jax.Array | None = None,
    isa: str | None = None,
) -> jax.Array:
    """x [rows, in] (any float; computed in float32), sorted by group . w [experts, out, in] -> float32
    [rows, out]. `w` is float (scale None), int8 with `scale` float32 [experts, out], or, with `minimum`,
    int4: w the packed uint8 [experts, out, in / 2] of an Int4Weight, scale and minimum float32
    [experts, out, in / group] (group a power of two from 32). group_sizes int [experts]. Runs the chosen
    variant (KERNEL.chosen_isa()), or the one named by `isa` ("avx512_vnni", "avx2")."""
    in_features = 2 * w.shape[-1] if minimum is not None else w.shape[-1]
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != in_features or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul wants x [rows, in], w [experts, out, in] (int4: packed [experts, out, in / 2]), "
            f"group_sizes [experts]; got x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape}"
        )
    out_type = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    x, group_sizes = x.astype(jnp.float32), group_sizes.astype(jnp.int32)
    if minimum is not None:
        groups = scale.shape[-1] if scale is not None and scale.ndim == 3 else 0
        group = in_features // groups if groups and in_features % groups == 0 else 0
        if (
            w.dtype != jnp.uint8
            or scale.shape != (*w.shape[:2], groups)
            or minimum.shape != scale.shape
            or group < INT4_MIN_GROUP
            or group & (group - 1)
        ):
            raise ValueError(
                f"int4 weights need packed uint8 [experts, out, in / 2] and scale and minimum [experts, out, "
                f"in / group], group a power of two from {INT4_MIN_GROUP}; got {w.dtype} {w.shape}, "
                f"scale {None if scale is None else scale.shape}, minimum {minimum.shape}"
            )
        call = jax.ffi.ffi_call(KERNEL.target(SYMBOL_INT4, isa), out_type)
        return call(x, w, scale.astype(jnp.float32), minimum.astype(jnp.float32), group_sizes)
    if scale is None:
        call = jax.ffi.ffi_call(KERNEL.target(SYMBOL_F32, isa), out_type)  # registers it on first use
        return call(x, w.astype(jnp.float32), group_sizes)
    if w.dtype != jnp.int8 or scale.shape != w.shape[:2]:
        raise ValueError(f"int8 weights need q int8 [experts, out, in] and scale [experts, out]; got "
                         f"{w.dtype} {w.shape}, scale {scale.shape}")  # fmt: skip
    call = jax.ffi.ffi_call(KERNEL.target(SYMBOL_INT8, isa), out_type)
    return call(x, w, scale.astype(jnp.float32), group_sizes)


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 [rows]: the group each row of a grouped product belongs to; rows past sum(group_sizes) get
    the number of groups."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def grouped_matmul_cpu_reference(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array | None,
    group_sizes: jax.Array,
    *,
    minimum: jax.Array | None = None,
) -> jax.Array:
    """The kernel's product in plain JAX: each row's group from the sizes, that group's (dequantised)
    weight gathered per row; rows past the last group are zeros. Arguments as grouped_matmul_cpu's."""
    experts = w.shape[0]
    group = row_groups(group_sizes, x.shape[0])
    if minimum is not None:
        group_size = 2 * w.shape[-1] // scale.shape[-1]
        w = Int4Weight(w, scale, minimum, group_size).dequantize()
    elif scale is not None:
        w = Int8Weight(w, scale).dequantize()
    else:
        w = w.astype(jnp.float32)
    picked = jnp.take(w, jnp.minimum(group, experts - 1), axis=0)  # [rows, out, in]
    y = jnp.einsum("ri,roi->ro", x.astype(jnp.float32), picked, precision=jax.lax.Precision.HIGHEST)
    return jnp.where((group < experts)[:, None], y, 0.0)
