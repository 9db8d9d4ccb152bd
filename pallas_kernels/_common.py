"""Helpers shared by the Pallas kernels: mask value, backend detection, block-size checks.

The kernels are written in the subset of Pallas that lowers on both TPU (Mosaic) and GPU (Triton):
the grid only has independent ("parallel") axes and every reduction over keys / the contraction axis
is a `lax.fori_loop` inside the kernel, because Triton programs of one grid run concurrently and
cannot carry an accumulator from one grid step to the next.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# Finite "minus infinity": exp(MASK_VALUE - m) underflows to 0 and MASK_VALUE - MASK_VALUE stays 0, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# TPU vreg tile: second-to-last block dim a multiple of 8 (sublanes), last a multiple of 128 (lanes).
NUM_SUBLANES = 8
NUM_LANES = 128


@functools.cache
def default_backend() -> str:
    return jax.default_backend()


def default_interpret() -> bool:
    """True where Pallas can only run in interpret mode (CPU); TPU and GPU lower natively."""
    return default_backend() not in ("tpu", "gpu", "cuda", "rocm")


def tpu_form(interpret) -> bool:
    """Whether a kernel takes its TPU (Mosaic) form: on TPU, or in TPU interpret mode
    (`interpret=pltpu.InterpretParams()`), which runs that form on CPU."""
    from jax.experimental.pallas import tpu as pltpu

    return isinstance(interpret, pltpu.InterpretParams) or (default_backend() == "tpu" and not interpret)


def min_dot_rows() -> int:
    """Fewest rows for a kernel matmul operand: Triton's tl.dot needs 16, a TPU tile has 8 sublanes."""
    return 16 if default_backend() in ("gpu", "cuda", "rocm") else 8


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def largest_divisor_block(n: int, preferred: int, minimum: int = 1) -> int:
    """Largest power of two <= `preferred` that divides `n` (at least `minimum`, else ValueError)."""
    block = preferred
    while block > minimum and n % block:
        block //= 2
    if n % block:
        raise ValueError(f"no power-of-two block in [{minimum}, {preferred}] divides {n=}")
    return block


def check_block(name: str, value: int) -> None:
    """Blocks must be positive powers of two (Triton needs them; they also tile TPU vregs cleanly)."""
    if not isinstance(value, int) or not is_power_of_two(value):
        raise ValueError(f"{name}={value!r} must be a positive power of two")


def scalar_table_spec(shape: tuple[int, ...], smem: bool = False) -> pl.BlockSpec:
    """BlockSpec for a small int32 table (lengths, offsets) read with scalar indexing in the kernel.

    The whole table is one block. On TPU (or with `smem`, for TPU interpret mode) it lives in SMEM
    (scalar memory); elsewhere it is an ordinary block (a pointer on GPU, an array in interpret mode).
    """
    index_map = lambda *_: (0,) * len(shape)  # noqa: E731
    if smem or default_backend() == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(shape, index_map)


def compiler_params(num_warps: int | None = None, num_stages: int | None = None):
    """Triton params on GPU (always: jax 0.10 lowers a GPU pallas_call without them through Mosaic GPU,
    which our kernels do not target); None elsewhere (Mosaic TPU's defaults suit all-parallel grids)."""
    if default_backend() in ("gpu", "cuda", "rocm"):
        from jax.experimental.pallas import triton as pltriton

        tuning = {"num_warps": num_warps, "num_stages": num_stages}
        return pltriton.CompilerParams(**{name: value for name, value in tuning.items() if value is not None})
    return None


def cdiv_nonneg(x: jax.Array, d: int) -> jax.Array:
    """ceil(max(x, 0) / d) for traced ints, via truncating division (no sign handling to lower)."""
    x = jnp.maximum(x, 0)
    return lax.div(x + (d - 1), jnp.asarray(d, x.dtype))


def div_nonneg(x: jax.Array, d: int) -> jax.Array:
    """floor(max(x, 0) / d) for traced ints; `//` would emit sign fix-ups that Mosaic lowers poorly."""
    x = jnp.maximum(x, 0)
    return lax.div(x, jnp.asarray(d, x.dtype))


def dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b[n, k].T -> [m, n] in f32 (contracts the last dims; no transpose is materialised)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] -> [m, n] in f32."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def pad_axis(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    """Pad `x` along `axis` up to a multiple of `multiple` (no copy when already aligned)."""
    size = x.shape[axis]
    padded = pl.cdiv(size, multiple) * multiple
    if padded == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, padded - size)
    return jnp.pad(x, widths, constant_values=value)


def export_for_platform(fn, platform: str, *args):
    """Lower `fn(*args)` for "cuda" (Triton) or "tpu" (Mosaic) without that hardware, as on a CPU-only CI.

    Runs the Pallas-to-Triton / Pallas-to-Mosaic lowering (block shapes, ops, index maps), not the final
    device compiler. Returns the `jax.export.Exported`; raises what the lowering raises.
    """
    from jax import export

    global default_backend
    saved = default_backend
    # Traces are cached without regard to the backend switch below: drop them on the way in and out.
    jax.clear_caches()
    default_backend = lambda: {"cuda": "gpu", "tpu": "tpu"}[platform]  # noqa: E731
    try:
        targets = ("__gpu$xla.gpu.triton", "tpu_custom_call")
        checks = [export.DisabledSafetyCheck.custom_call(target) for target in targets]
        return export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    finally:
        default_backend = saved
        jax.clear_caches()


# Decode has 1-8 rows; pad them to one block of at least this many (TPU sublanes: 8, Triton tl.dot: 16).
MIN_BLOCK_M = 16


@dataclasses.dataclass(frozen=True)
class MatmulBlockSizes:
    """Output tile [block_m, block_n] and contraction step block_k (powers of two, block_k in weights) of
    the weight matmuls (int8_matmul, int4_matmul). int8 with per-group scales steps one group at a time;
    int4 needs block_k a multiple of its group, which the default is (k is a multiple of the group, a
    power of two <= 512)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 512

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        check_block("block_k", self.block_k)

    @classmethod
    def get_default(cls, m: int, n: int, k: int) -> MatmulBlockSizes:
        return cls(
            block_m=min(128, max(MIN_BLOCK_M, pl.next_power_of_2(m))),
            block_n=largest_divisor_block(n, preferred=128),
            block_k=largest_divisor_block(k, preferred=512),
        )
