"""int4 (and int5) weights times int8-quantised activations on x86-64 CPUs: a C++ XLA FFI kernel
(int4_matmul.cc) built for AVX-512 VNNI, AVX-VNNI and AVX2, the fastest variant this CPU runs chosen at run
time.

XLA:CPU has no fast form of a 4-bit weight: unpacking nibbles in the graph runs far slower than the float
product. The kernel reads the packed nibbles once per row group, quantises the activations per row and
block of 32 inputs (symmetric int8, as llama.cpp's Q8_0 activations) and multiplies bytes: vpdpbusd on
AVX-512 VNNI (and on 256 bits with AVX-VNNI), vpmaddubsw + vpmaddwd on AVX2. The group minimums multiply
the float sums of the activations, so only the q * scale part sees activation rounding.

`pack_int4` turns a weight_formats.Int4Weight into the kernel's PackedInt4Weight (the packed bytes replace
the Int4Weight's, so the weight is held once), with float16 scales and minimums where `exact_in_float16`
says no value changes (GGUF's Q4_0 and Q4_1 blocks store theirs so): at a group of 32 that is 5 bits per
weight instead of 6, and a one-row product is bound by the bytes it reads. `unpack_int4` inverts it.
`pack_int5` does the same for an Int5Weight (GGUF's Q5_0 / Q5_1 blocks): its low four bits in the int4
layout, its fifth bits as one 64-bit mask per 64 packed bytes, which the AVX-512 kernel applies to the
unpacked nibbles with one masked add (int5 reads 6 bits per weight with float16 scales, int8 8.25).
`int4_matmul_cpu_reference` is the kernel's arithmetic in plain JAX, for either format.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.cpu_kernels.native_build import NativeKernel
from jaxinfer.weight_formats import Int4Weight, Int5Weight, PackedInt4Weight, PackedInt5Weight
from pallas_kernels import quantize_int8

SYMBOL = "jaxinfer_int4_matmul"
SYMBOL_INT5 = "jaxinfer_int5_matmul"
BLOCK_N = 16  # outputs per packed 64-byte vector
CHUNK_K = 8  # inputs per packed 64-byte vector (two nibbles of four inputs per output)
ACTIVATION_BLOCK = 32  # inputs per activation scale
KERNEL = NativeKernel(Path(__file__).with_suffix(".cc"), (SYMBOL, SYMBOL_INT5), "the native int4 kernel")


def int4_matmul_available(isa: str | None = None) -> bool:
    """Whether this process runs the kernel (the chosen variant, or `isa`'s): an x86-64 CPU with AVX2 or
    AVX-512 VNNI, a C++ compiler, JAXINFER_NATIVE_KERNELS not 0. Builds and registers it once."""
    return KERNEL.available(isa)


def supports(out_features: int, in_features: int) -> bool:
    """Weight shapes the kernel takes: out % 16 == 0 (in is a multiple of the int4 group already)."""
    return out_features % BLOCK_N == 0 and in_features % ACTIVATION_BLOCK == 0


def exact_in_float16(w: Int4Weight | Int5Weight) -> bool:
    """Whether every scale and minimum of `w` is a float16 value exactly (reads them to the host)."""
    for a in (w.scale, w.minimum):
        a = np.asarray(a, np.float32)
        if not np.array_equal(a.astype(np.float16).astype(np.float32), a):
            return False
    return True


def pack_int4(w: Int4Weight, half_scales: bool = False) -> PackedInt4Weight:
    """Int4Weight [out, in] -> the kernel layout: packed uint8 [out/16, in/8, 16, 4], where byte j of
    output lane o in chunk c holds q[o, 8c + j] in its low nibble and q[o, 8c + 4 + j] in its high one
    (one 64-byte load feeds two vpdpbusd over four inputs each); scale and minimum [out/16, groups, 16],
    float16 with `half_scales` (lossless only where exact_in_float16(w)), else float32."""
    out_features, in_features = w.shape
    q = w.values().reshape(out_features // BLOCK_N, BLOCK_N, in_features // CHUNK_K, 2, 4)
    packed = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).transpose(0, 2, 1, 3)

    def lanes(a: jax.Array) -> jax.Array:
        a = a.reshape(out_features // BLOCK_N, BLOCK_N, -1).transpose(0, 2, 1)
        return a.astype(jnp.float16 if half_scales else jnp.float32)

    return PackedInt4Weight(packed, lanes(w.scale), lanes(w.minimum), w.group_size, in_features)


def pack_int5(w: Int5Weight, half_scales: bool = False) -> PackedInt5Weight:
    """Int5Weight [out, in] -> the kernel layout: pack_int4's of the low four bits, and the fifth bits
    high uint8 [out/16, in/8, 16]: per chunk two little-endian 64-bit masks over its 64 packed bytes, bit
    4o + j set where the value in byte j of lane o's low nibble (bytes 0-7), high nibble (bytes 8-15)
    has its fifth bit."""
    out_features, in_features = w.shape
    q = w.values()
    low = pack_int4(Int4Weight.from_values(q & 15, w.scale, w.minimum, w.group_size), half_scales)
    fifth = (q >> 4).reshape(out_features // BLOCK_N, BLOCK_N, in_features // CHUNK_K, 2, 4)
    # [blocks, chunks, nibble, lane o, j] -> bit 4o + j of a 64-bit mask, as 8 bytes of 8 bits each
    bits = fifth.transpose(0, 2, 3, 1, 4).reshape(*fifth.shape[:1], in_features // CHUNK_K, 2, 8, 8)
    high = (bits.astype(jnp.uint8) << jnp.arange(8, dtype=jnp.uint8)).sum(-1, dtype=jnp.uint8)
    high = high.reshape(out_features // BLOCK_N, in_features // CHUNK_K, 16)
    return PackedInt5Weight(low.packed, high, low.scale, low.minimum, w.group_size, in_features)


def unpack_int4(p: PackedInt4Weight | PackedInt5Weight) -> Int4Weight | Int5Weight:
    """Inverse of pack_int4 and pack_int5."""
    blocks, chunks = p.packed.shape[:2]
    pairs = jnp.stack([p.packed & 15, p.packed >> 4], axis=3)  # [blocks, chunks, 16, 2, 4]
    if isinstance(p, PackedInt5Weight):
        bits = (p.high.reshape(blocks, chunks, 2, 8, 1) >> jnp.arange(8, dtype=jnp.uint8)) & 1
        fifth = bits.reshape(blocks, chunks, 2, BLOCK_N, 4).transpose(0, 1, 3, 2, 4)  # [.., 16, 2, 4]
        pairs = pairs | (fifth << 4)
    q = pairs.transpose(0, 2, 1, 3, 4).reshape(blocks * BLOCK_N, chunks * CHUNK_K)

    def rows(a: jax.Array) -> jax.Array:
        return a.transpose(0, 2, 1).reshape(blocks * BLOCK_N, -1).astype(jnp.float32)

    kind = Int5Weight if isinstance(p, PackedInt5Weight) else Int4Weight
    return kind.from_values(q, rows(p.scale), rows(p.minimum), p.group_size)


def int4_matmul_cpu(
    x: jax.Array, w: PackedInt4Weight | PackedInt5Weight, *, layer: int | None = None, isa: str | None = None
) -> jax.Array:
    """x [rows, in] float . w (pack_int4's or pack_int5's form of [out, in]) -> [rows, out] float32. With
    `layer`, w's arrays stack every layer's weight along a leading axis (layer_stack.py) and the kernel
    reads that layer's in place. Runs the chosen variant (KERNEL.chosen_isa()), or the one named by `isa`
    ("avx512_vnni", "avx_vnni", "avx2")."""
    five = isinstance(w, PackedInt5Weight)
    target = KERNEL.target(SYMBOL_INT5 if five else SYMBOL, isa)  # registers it on first use
    blocks, chunks = w.packed.shape[-4:-2]
    if w.packed.ndim != (4 if layer is None else 5) or x.ndim != 2 or x.shape[1] != chunks * CHUNK_K:
        raise ValueError(f"x {x.shape} does not fit an int{5 if five else 4} weight of {w.packed.shape}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], blocks * BLOCK_N), jnp.float32))
    fifth = (w.high,) if five else ()
    return call(x.astype(jnp.float32), w.packed, *fifth, w.scale, w.minimum, layer=np.int64(layer or 0))


def int4_matmul_cpu_reference(x: jax.Array, w: Int4Weight | Int5Weight) -> jax.Array:
    """The kernel's arithmetic in plain JAX on the unpacked Int4Weight or Int5Weight."""
    rows, in_features = x.shape
    out_features = w.shape[0]
    blocks = in_features // ACTIVATION_BLOCK
    x = x.astype(jnp.float32)
    x_q, x_scale = quantize_int8(x, group_size=ACTIVATION_BLOCK)  # [rows, in], [rows, blocks]
    q = w.values().reshape(out_features, blocks, ACTIVATION_BLOCK)
    partial = jnp.einsum(
        "rbk,obk->rbo", x_q.reshape(rows, blocks, -1), q.astype(jnp.int8), preferred_element_type=jnp.int32
    )  # [rows, blocks, out]
    per_group = w.group_size // ACTIVATION_BLOCK
    block_scale = jnp.repeat(w.scale, per_group, axis=1)  # [out, blocks]
    product = jnp.einsum("rbo,rb,ob->ro", partial.astype(jnp.float32), x_scale, block_scale)
    x_sums = x.reshape(rows, -1, w.group_size).sum(-1)  # [rows, groups]
    return product + x_sums @ w.minimum.T
