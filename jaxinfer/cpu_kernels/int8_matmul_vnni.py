"""int8 x int8 matmul on x86-64 CPUs: a C++ XLA FFI kernel (int8_matmul_vnni.cc) built for AVX-512 VNNI,
AVX-VNNI and AVX2, the fastest variant this CPU runs chosen at run time (native_build.best_isa).

XLA:CPU runs products of several rows through YNNPACK, which repacks the weight on every call and
reaches ~80 GMAC/s in bf16 on this project's 2-core machine (Gemma 3's 262k x 640 logits product at 16
rows: ~30 ms). This kernel reads a weight packed once at load time (`pack_weight`) and multiplies
bytes: vpdpbusd on AVX-512 VNNI (the same product in ~11 ms) and on 256 bits with AVX-VNNI, vpmaddubsw +
vpmaddwd on AVX2 (the signs of the activations moved onto the weights, so no 16-bit pair sum saturates).
All read the one packed layout.

The kernel takes float activations and quantises them per row and per block of ACTIVATION_BLOCK input
channels (symmetric, int8; quantize_activations.h, shared with the int4 kernel), so an outlier channel
coarsens only its own block of 32 (llama.cpp quantises activations the same way).
`int8_matmul_vnni_reference` is the same arithmetic in plain JAX.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cpu_kernels.native_build import NativeKernel
from pallas_kernels import quantize_int8

SYMBOL = "jaxinfer_int8_matmul_vnni"  # the handler of each ISA variant: SYMBOL + isa.suffix
BLOCK_N = 16  # outputs per packed 64-byte weight vector
BLOCK_K = 4  # input channels per vpdpbusd lane
ACTIVATION_BLOCK = 32  # input channels per activation scale (as llama.cpp's Q8_0; 128 runs no faster)
OFFSET = 128  # vpdpbusd takes unsigned weights: w + 128, corrected by 128 * sum(x_q) per block
KERNEL = NativeKernel(Path(__file__).with_suffix(".cc"), (SYMBOL,), "the native int8 kernel")


def vnni_available() -> bool:
    """Whether this process runs the kernel (KERNEL.available(): an x86-64 CPU with AVX2 or AVX-512 VNNI,
    a C++ compiler, JAXINFER_NATIVE_KERNELS not 0). Builds and registers it once."""
    return KERNEL.available()


def supports(out_features: int, in_features: int) -> bool:
    """Weight shapes the kernel takes: [out, in] with out % 16 == 0 and in % ACTIVATION_BLOCK == 0."""
    return out_features % BLOCK_N == 0 and in_features % ACTIVATION_BLOCK == 0


def pack_weight(q: jax.Array) -> jax.Array:
    """int8 [out, in] -> uint8 [out/16, in/4, 16, 4]: q + 128, four consecutive inputs of 16 outputs
    per 64 bytes, the operand layout of vpdpbusd."""
    out_features, in_features = q.shape
    shifted = (q.astype(jnp.int16) + OFFSET).astype(jnp.uint8)
    blocks = shifted.reshape(out_features // BLOCK_N, BLOCK_N, in_features // BLOCK_K, BLOCK_K)
    return blocks.transpose(0, 2, 1, 3)


def int8_matmul_vnni(
    x: jax.Array, packed: jax.Array, scale: jax.Array, *, layer: int | None = None, isa: str | None = None
) -> jax.Array:
    """x [rows, in] float . int8 weight [out, in] (packed by pack_weight; scale float32 [out] per output
    channel) -> [rows, out] float32. With `layer`, packed and scale stack every layer's along a leading
    axis (layer_stack.py) and the kernel reads that layer's in place. Runs the chosen variant
    (KERNEL.chosen_isa(); needs vnni_available()), or the one named by `isa` ("avx512_vnni", "avx_vnni",
    "avx2"), which this CPU must support."""
    target = KERNEL.target(SYMBOL, isa)  # registers it on first use
    blocks, quads = packed.shape[-4:-2]
    if packed.ndim != (4 if layer is None else 5) or x.ndim != 2 or x.shape[1] != quads * BLOCK_K:
        raise ValueError(f"x {x.shape} does not fit a packed int8 weight of {packed.shape}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], blocks * BLOCK_N), jnp.float32))
    return call(x.astype(jnp.float32), packed, scale.astype(jnp.float32), layer=np.int64(layer or 0))


def int8_matmul_vnni_reference(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """The kernel's arithmetic in plain JAX, on the unpacked int8 weight q [out, in]."""
    rows, in_features = x.shape
    blocks = in_features // ACTIVATION_BLOCK
    x_q, x_scale = quantize_int8(x.astype(jnp.float32), group_size=ACTIVATION_BLOCK)
    partial = jnp.einsum(
        "rbk,obk->rbo", x_q.reshape(rows, blocks, -1), q.reshape(q.shape[0], blocks, -1),
        preferred_element_type=jnp.int32,
    )  # fmt: skip
    return jnp.einsum("rbo,rb->ro", partial.astype(jnp.float32), x_scale) * scale
