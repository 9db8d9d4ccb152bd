"""The weight formats: a linear weight (or the embedding table) is a float array or one of the types below.

Each type is a frozen dataclass registered as a pytree: its arrays are the children (so `jax.jit`,
`jax.device_put`, sharding and orbax see plain arrays), its group size is static metadata. Loaders,
kernel dispatch (kernel_dispatch.linear), checkpoints, sharding rules and memory accounting go through
these types; adding a format means a class here, its kernels and its tests.

    Int8Weight        w[o, i] = q[o, i] * scale[o]                      (8.0 bits per weight)
    Int4Weight        w[o, i] = q[o, i] * scale[o, g] + minimum[o, g]   (4 + 64 / group_size bits)
                      q in [0, 15], g = i // group_size; or stacked expert weights [experts, out, in]
                      with scale and minimum [experts, out, groups] (models/moe.py)
    PackedInt4Weight  an Int4Weight in the native CPU kernel's layout (cpu_kernels/int4_matmul.py)
    Int5Weight        w[o, i] = q[o, i] * scale[o, g] + minimum[o, g],  q in [0, 31]  (5 + 64 / 32 bits)
    PackedInt5Weight  an Int5Weight in the same kernel's layout, its fifth bits beside the nibbles
    LayerOf           one layer of a packed or VNNI weight whose arrays stack every layer's

Int4Weight holds float32 scales and minimums so that GGUF's 4-bit blocks map onto it exactly: Q4_0
(w = d * (q - 8): scale d, minimum -8d), Q4_1 (w = d * q + m) and Q4_K (each 32-weight sub-block: scale
d * sc, minimum -dmin * m, products of a float16 and a 6-bit integer, exact in float32). At a group of 32
that is 6 bits per weight: 19% of float32, 75% of int8. Int5Weight keeps GGUF's 5-bit blocks the same
way (Q5_0: w = d * (q - 16); Q5_1: w = d * q + m), at 7 bits per weight (6 with the CPU kernel's float16
scales) where int8 would take 8 and round them again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels

INT4_LEVELS = 15  # q in [0, 15]
INT4_GROUP_SIZES = (32, 128)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["q", "scale", "vnni", "bf16"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """Symmetric int8 with one scale per output channel (per vocabulary row for the embedding table, so
    the same scales serve the lookup and the tied logits projection).

    q: int8 [out, in], or None where `vnni` alone holds the values (quantization.add_vnni_weights with
        keep_int8=False); scale: float32 [out].
    vnni: the same bytes packed for the CPU VNNI kernel (cpu_kernels.pack_weight), uint8
        [out/16, in/4, 16, 4], or None.
    bf16: the dequantised weight in bfloat16 [out, in] for products of several rows on XLA:CPU, or None.
    """

    q: Any
    scale: Any
    vnni: Any = None
    bf16: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.q is None:
            blocks, quads, lanes, four = self.vnni.shape
            return (blocks * lanes, quads * four)
        return tuple(self.q.shape)

    def rows(self, index: jax.Array) -> jax.Array:
        """int8 rows q[index] [..., in], read from q or, without it, from the VNNI layout."""
        if self.q is not None:
            return jnp.take(self.q, index, axis=0)
        lanes = self.vnni.shape[2]
        picked = self.vnni[index // lanes, :, index % lanes, :]  # [..., in/4, 4] of q + 128
        return (picked.reshape(*index.shape, -1).astype(jnp.int16) - 128).astype(jnp.int8)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        q = self.q if self.q is not None else self.rows(jnp.arange(self.shape[0]))
        return (q.astype(jnp.float32) * self.scale[..., None]).astype(dtype)


def _dequantize_groups(w, dtype) -> jax.Array:
    """w.values() * scale + minimum per group of w.group_size inputs (an Int4Weight or Int5Weight)."""
    shape = w.shape
    groups = w.values().reshape(*shape[:-1], -1, w.group_size).astype(jnp.float32)
    return (groups * w.scale[..., None] + w.minimum[..., None]).reshape(shape).astype(dtype)


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["packed", "scale", "minimum"], meta_fields=["group_size"]
)
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """Asymmetric 4-bit values per group of `group_size` consecutive inputs.

    packed: uint8 [out, in / 2]; byte j holds q[o, 2j] in its low nibble and q[o, 2j + 1] in its high one.
    scale, minimum: float32 [out, in / group_size].
    A stacked expert weight [experts, out, in] (models/moe.py) has one more leading axis on every array:
    packed [experts, out, in / 2], scale and minimum [experts, out, in / group_size], the bytes of each
    expert laid out as a 2-D weight's.
    """

    packed: Any
    scale: Any
    minimum: Any
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def values(self) -> jax.Array:
        """q: uint8 [..., out, in] in [0, 15]."""
        p = self.packed
        return jnp.stack([p & 15, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w = q * scale + minimum per group, [..., out, in] in `dtype` (computed in float32)."""
        return _dequantize_groups(self, dtype)

    @classmethod
    def from_values(cls, q, scale, minimum, group_size: int) -> Int4Weight:
        """From unpacked q uint8 [..., out, in] in [0, 15] (numpy or jax; numpy stays on the host)."""
        xp = np if isinstance(q, np.ndarray) else jnp
        pairs = q.reshape(*q.shape[:-1], -1, 2).astype(xp.uint8)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
        return cls(packed.astype(xp.uint8), scale, minimum, group_size)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["packed", "scale", "minimum"],
    meta_fields=["group_size", "in_features"],
)
@dataclasses.dataclass(frozen=True)
class PackedInt4Weight:
    """An Int4Weight in the layout of the native CPU kernel (cpu_kernels.int4_matmul: pack_int4 builds
    it and documents the layout); it replaces the Int4Weight, so the weight is held once."""

    packed: Any  # uint8 [out / 16, in / 8, 16, 4]
    scale: Any  # float32 [out / 16, in / group_size, 16], or float16 where every value is one exactly
    minimum: Any  # [out / 16, in / group_size, 16], the scale's dtype
    group_size: int = 32
    in_features: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0] * self.packed.shape[2], self.in_features)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["packed", "high", "scale", "minimum"],
    meta_fields=["group_size"],
)
@dataclasses.dataclass(frozen=True)
class Int5Weight:
    """Asymmetric 5-bit values per group of `group_size` consecutive inputs (GGUF's Q5_0 / Q5_1 blocks).

    packed: uint8 [out, in / 2], the low four bits of q as Int4Weight.packed holds them.
    high: uint8 [out, in / 8]; bit j of byte b is the fifth bit of q[o, 8b + j].
    scale, minimum: float32 [out, in / group_size]; w = q * scale + minimum, q in [0, 31].
    """

    packed: Any
    high: Any
    scale: Any
    minimum: Any
    group_size: int = 32

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def values(self) -> jax.Array:
        """q: uint8 [out, in] in [0, 31]."""
        low = Int4Weight(self.packed, self.scale, self.minimum, self.group_size).values()
        bits = (self.high[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1  # [out, in / 8, 8]
        return low | (bits.reshape(low.shape) << 4).astype(jnp.uint8)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """w = q * scale + minimum per group, [out, in] in `dtype` (computed in float32)."""
        return _dequantize_groups(self, dtype)

    @classmethod
    def from_values(cls, q, scale, minimum, group_size: int) -> Int5Weight:
        """From unpacked q uint8 [out, in] in [0, 31] (numpy or jax; numpy stays on the host)."""
        xp = np if isinstance(q, np.ndarray) else jnp
        low = Int4Weight.from_values(q & 15, scale, minimum, group_size)
        bits = (q >> 4).reshape(*q.shape[:-1], -1, 8).astype(xp.uint8)
        high = (bits << xp.arange(8, dtype=xp.uint8)).sum(-1, dtype=xp.uint8)
        return cls(low.packed, high, scale, minimum, group_size)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["packed", "high", "scale", "minimum"],
    meta_fields=["group_size", "in_features"],
)
@dataclasses.dataclass(frozen=True)
class PackedInt5Weight:
    """An Int5Weight in the layout of the native CPU kernel (cpu_kernels.int4_matmul: pack_int5 builds it
    and documents the layout); it replaces the Int5Weight, so the weight is held once."""

    packed: Any  # uint8 [out / 16, in / 8, 16, 4]: the low four bits, as PackedInt4Weight.packed
    high: Any  # uint8 [out / 16, in / 8, 16]: the fifth bits
    scale: Any  # float32 [out / 16, in / group_size, 16], or float16 where every value is one exactly
    minimum: Any  # [out / 16, in / group_size, 16], the scale's dtype
    group_size: int = 32
    in_features: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.packed.shape[0] * self.packed.shape[2], self.in_features)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weight"], meta_fields=["layer"])
@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `layer` of `weight`, whose arrays stack every layer's along a leading axis: how a model
    served by the native CPU kernels holds its layers (layer_stack.py)."""

    weight: Any  # PackedInt4Weight, PackedInt5Weight or Int8Weight (VNNI form only), arrays [layers, ...]
    layer: int

    @property
    def one_layer(self) -> Any:
        """The weight with one layer's shapes (abstract arrays: for shapes and byte counts)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), self.weight)

    @property
    def shape(self) -> tuple[int, int]:
        return self.one_layer.shape

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's arrays (what a product over it reads)."""
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(self.one_layer))


QUANTIZED_TYPES = (Int8Weight, Int4Weight, PackedInt4Weight, Int5Weight, PackedInt5Weight, LayerOf)
GROUPED_TYPES = (Int4Weight, PackedInt4Weight, Int5Weight, PackedInt5Weight)  # scales per group of inputs


def is_quantized(w) -> bool:
    return isinstance(w, QUANTIZED_TYPES)


def format_name(w) -> str:
    """ "float", "int8", "int4" or "int5" (either layout)."""
    if isinstance(w, LayerOf):
        return format_name(w.weight)
    if isinstance(w, Int8Weight):
        return "int8"
    if isinstance(w, (Int4Weight, PackedInt4Weight)):
        return "int4"
    if isinstance(w, (Int5Weight, PackedInt5Weight)):
        return "int5"
    return "float"


def logical_shape(w) -> tuple[int, ...]:
    """The [out, in] shape of the weight a leaf stands for, whatever its format."""
    return tuple(w.shape)


def quantize_int8(w: jax.Array) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float [out, in], or of each expert's [out, in] in a stacked
    [experts, out, in] (scale [experts, out]); all-zero rows get scale 1."""
    if w.ndim == 3:
        return Int8Weight(*jax.vmap(pallas_kernels.quantize_int8)(w))
    return Int8Weight(*pallas_kernels.quantize_int8(w))


def int4_group_size(in_features: int, preferred: int) -> int | None:
    """`preferred` where it divides the inputs, else the largest group size that does; None if none does."""
    fitting = [g for g in INT4_GROUP_SIZES if g <= preferred and in_features % g == 0]
    return max(fitting, default=None)


def check_int4_shape(shape: tuple[int, ...], group_size: int) -> None:
    """A [out, in] weight, or stacked expert weights [experts, out, in], with `in` a multiple of a group
    size int4 takes."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if len(shape) not in (2, 3) or shape[-1] % group_size:
        raise ValueError(
            f"int4 needs a [out, in] or [experts, out, in] weight with in a multiple of {group_size}; "
            f"got {shape}"
        )


def int4_grid(
    w: jax.Array, group_size: int, clip: jax.Array | None = None, round_fn=jnp.round
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The asymmetric int4 levels of a float [out, in] per group of `group_size` inputs:
    (q float32 [out, groups, group_size] in [0, 15], scale [out, groups], minimum [out, groups]); of
    stacked expert weights [experts, out, in], the same per expert with a leading [experts] axis (each
    group on its own, so each expert's levels are those of its 2-D matrix, bit for bit).

    clip: optional [out, groups] (or [experts, out, groups]) factors in (0, 1] that shrink each group's
    [min, max] range around its midpoint (int4_calibration fits them); values outside the clipped range
    saturate to q = 0 or 15.
    round_fn: jnp.round, or a straight-through rounding to train the clips through.
    """
    check_int4_shape(tuple(w.shape), group_size)
    groups = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    low, high = jnp.min(groups, axis=-1), jnp.max(groups, axis=-1)
    if clip is not None:
        mid, half = (high + low) / 2, (high - low) / 2 * clip
        low, high = mid - half, mid + half
    scale = jnp.where(high > low, (high - low) / INT4_LEVELS, 1.0)
    q = jnp.clip(round_fn((groups - low[..., None]) / scale[..., None]), 0, INT4_LEVELS)
    return q, scale, low


def quantize_int4(w: jax.Array, group_size: int = 32, clip: jax.Array | None = None) -> Int4Weight:
    """Round-to-nearest asymmetric int4 of a float [out, in], or of each expert's [out, in] in stacked
    [experts, out, in] (int4_grid's levels, clipped by `clip`)."""
    q, scale, low = int4_grid(w, group_size, clip)
    return Int4Weight.from_values(q.astype(jnp.uint8).reshape(w.shape), scale, low, group_size)


def concat_rows(weights: list) -> Any:
    """Weights of one format stacked along `out` (fused projections); float arrays or Int8/4/5Weight."""
    first = weights[0]
    if not all(type(w) is type(first) for w in weights):
        raise ValueError(f"cannot fuse weights of formats {[format_name(w) for w in weights]}")
    if isinstance(first, (Int4Weight, Int5Weight)):
        if len({w.group_size for w in weights}) != 1:
            raise ValueError(f"cannot fuse {format_name(first)} weights of different group sizes")
    if isinstance(first, (PackedInt4Weight, PackedInt5Weight)):
        raise ValueError("fuse projections before packing for the CPU kernel")
    return jax.tree.map(lambda *arrays: jnp.concatenate(arrays), *weights)


def describe(w) -> dict[str, Any]:
    """What a checkpoint records about a leaf so it can be restored into the same type."""
    if isinstance(w, (Int4Weight, Int5Weight)):
        return {"format": format_name(w), "group_size": w.group_size}
    if isinstance(w, (PackedInt4Weight, PackedInt5Weight)):
        raise ValueError(f"save the {format_name(w)} weight's own form, not the CPU kernel's packing")
    return {"format": format_name(w)}


def abstract_weight(description: dict[str, Any], shape: tuple[int, ...], target, float_dtype) -> Any:
    """The restore target of a leaf `describe` described: target(suffix, shape, dtype) makes each array's
    target (a jax.ShapeDtypeStruct with its sharding), suffix naming the field ("" for a float array)."""
    kind = description.get("format", "float")
    if kind == "float":
        return target("", shape, float_dtype)
    *lead, out_features, in_features = shape  # lead: [experts] for a stacked expert weight
    if kind == "int8":
        return Int8Weight(target("q", shape, np.int8), target("scale", (*lead, out_features), np.float32))
    if kind == "int4":
        group_size = int(description["group_size"])
        check_int4_shape(shape, group_size)
        groups = (*lead, out_features, in_features // group_size)
        return Int4Weight(
            target("packed", (*lead, out_features, in_features // 2), np.uint8),
            target("scale", groups, np.float32),
            target("minimum", groups, np.float32),
            group_size,
        )
    if kind == "int5":
        group_size = int(description["group_size"])
        check_int4_shape(shape, group_size)
        if lead:
            raise ValueError("int5 holds one [out, in] matrix, not stacked experts")
        groups = (out_features, in_features // group_size)
        return Int5Weight(
            target("packed", (out_features, in_features // 2), np.uint8),
            target("high", (out_features, in_features // 8), np.uint8),
            target("scale", groups, np.float32),
            target("minimum", groups, np.float32),
            group_size,
        )
    raise ValueError(f"unknown weight format {kind!r}")
