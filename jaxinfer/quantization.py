"""Weight quantisation of a params pytree, once, at load or convert time: which leaves, which format.

The formats themselves are weight_formats' types. `quantize_params(params, mode)`:
  int8: every linear weight [out, in] and the embedding table [vocab, hidden] become Int8Weight, and so
        do mixture-of-experts weights [experts, out, in], with a scale per expert and output channel
        (models/moe.py's grouped matmuls read them).
  int4: the linear weights of every layer become Int4Weight (groups of 32 inputs, round-to-nearest or
        with clipping ranges from int4_calibration.calibrate_int4), and so do the stacked expert weights
        (round-to-nearest, each expert's groups as a 2-D weight's: a stacked Int4Weight with scale and
        minimum [experts, out, groups], read by the grouped matmuls); a weight whose inputs no int4 group
        divides becomes Int8Weight instead. The embedding table and an untied lm_head become Int8Weight,
        as llama.cpp's 4-bit files keep them at 6-8 bits: they are a small share of a large model's bytes
        and the logits are sensitive to them. The routers stay float in every mode.
Norms stay float. Leaves already quantised (a GGUF file's own 4- and 5-bit blocks, loading/gguf_loader.py)
are kept. Leaves are quantised one at a time on their devices and the float copy is freed at once, so peak
memory stays near one float copy.

Kernel forms, added after quantisation for the backend that runs them (runtime.add_kernel_forms):
`add_vnni_weights` repacks each Int8Weight's bytes for the native VNNI kernel, which then serves its
products at every row count on x86 CPUs (cpu_kernels/int8_matmul_vnni.py). Without it,
`add_bf16_copies` gives each Int8Weight a "bf16" copy for products of more than a few rows on XLA:CPU
(kernel_dispatch.ROWS_AS_VECTORS): there the int8 form is only fast as a matrix-vector product, while a
bf16 x bf16 -> f32 dot at 16-512 rows is as fast as an int8 x int8 one without quantising the
activations (measured on SmolLM2's shapes: 16 rows 29.7 vs 29.2 ms, 128 rows 106 vs 135 ms). It triples
the weight memory of the int8 model (still 75% of f32). `pack_int4_weights` replaces each Int4Weight by
the native int4 kernel's layout (cpu_kernels/int4_matmul.py), which serves every row count, and each
Int5Weight (a GGUF file's 5-bit blocks, kept as they are in int4 mode) by the same kernel's int5 form. Stacked
expert weights take none of these forms: the grouped-matmul kernels read their int8 or int4 bytes as
they are.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxinfer.cpu_kernels import exact_in_float16, int4_matmul_supports, pack_int4, pack_int5, pack_weight
from jaxinfer.cpu_kernels import supports as supports_vnni
from jaxinfer.models.params import Params
from jaxinfer.weight_formats import (
    Int4Weight,
    Int5Weight,
    Int8Weight,
    format_name,
    int4_group_size,
    is_quantized,
    quantize_int4,
    quantize_int8,
)

LINEAR_LEAVES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    | {"qkv_proj", "gate_up_proj"}  # fused forms (params.fuse_projections)
)
TABLE_LEAVES = frozenset({"embed", "lm_head"})
# Stacked expert weights [experts, out, in]: int8, or int4 in int4 mode (int8 where no group divides the
# inputs). The router stays float: it is small and picks the experts.
EXPERT_LEAVES = frozenset({"expert_gate", "expert_up", "expert_down"})
QUANTIZED_LEAVES = LINEAR_LEAVES | TABLE_LEAVES | EXPERT_LEAVES
QUANTIZATION_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZE = 32  # GGUF's block; 128 halves the scale bytes at some cost in accuracy
INT4_LEAVES = LINEAR_LEAVES | EXPERT_LEAVES  # the leaves int4 mode takes to 4 bits

_quantize_int8 = jax.jit(quantize_int8)
_quantize_int4 = jax.jit(quantize_int4, static_argnames="group_size")


def _consume(convert: Callable, w, *args, **kwargs):
    """convert(w, ...), then every array of `w` (a weight pytree or an array) freed: the weights are
    held once, in their new form."""
    converted = convert(w, *args, **kwargs)
    jax.tree.map(lambda a: a.delete(), w)
    return converted


def quantize_params(
    params: Params, mode: str = "int8", *, group_size: int = INT4_GROUP_SIZE, clips: dict | None = None
) -> Params:
    """Returns params with the weights `mode` covers quantised ("none" returns params unchanged).

    group_size: int4 group; a weight whose inputs it does not divide takes the largest group size that
    does (int8 where none does).
    clips: for int4, optional calibrated clipping factors keyed by (layer index, leaf name)
    (calibrate_int4); leaves without one are rounded to nearest. Consumes `params`: each float leaf is
    deleted once its quantised form exists.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZATION_MODES}")
    if mode == "none":
        return params
    clips = clips or {}

    def quantize(path: tuple, name: str, w):
        if name not in QUANTIZED_LEAVES or is_quantized(w):
            return w
        int4 = mode == "int4" and name in INT4_LEAVES
        group = int4_group_size(w.shape[-1], group_size) if int4 else None
        if group is not None:
            return _consume(_quantize_int4, w, group_size=group, clip=clips.get(path))
        return _consume(_quantize_int8, w)

    return map_weights(params, quantize)


def map_weights(params: Params, fn) -> Params:
    """params with fn(path, name, weight) applied to every named weight, top-level (path (name,)) and in
    each layer (path (layer index, name))."""
    top = {name: fn((name,), name, w) for name, w in params.items() if name != "layers"}
    top["layers"] = [
        {name: fn((i, name), name, w) for name, w in layer.items()}
        for i, layer in enumerate(params["layers"])
    ]
    return top


_dequantize_bf16 = jax.jit(lambda w: w.dequantize(jnp.bfloat16))


def _is_matrix_int8(w) -> bool:
    """An Int8Weight of one [out, in] matrix (stacked expert weights have their own kernels)."""
    return isinstance(w, Int8Weight) and len(w.shape) == 2


def _is_matrix_int4(w) -> bool:
    """An Int4Weight of one [out, in] matrix (not stacked experts, which the grouped matmuls read as is)."""
    return isinstance(w, Int4Weight) and len(w.shape) == 2


def add_bf16_copies(params: Params) -> Params:
    """Adds a bf16 dequantised copy to every Int8Weight matrix that lacks one (same sharding as q)."""

    def copy(path, name: str, w):
        if _is_matrix_int8(w) and w.bf16 is None:
            return Int8Weight(w.q, w.scale, w.vnni, _dequantize_bf16(w))
        return w

    return map_weights(params, copy)


_pack_vnni = jax.jit(pack_weight)


def add_vnni_weights(params: Params) -> Params:
    """Replaces q by `vnni`, the same bytes packed for the CPU VNNI kernel (cpu_kernels.int8_matmul_vnni),
    in every Int8Weight whose shape that kernel takes, and gives the others a bf16 copy: the forms of
    KernelConfig(matmul="native"). The kernel serves every row count and embedding rows are read from
    the packed bytes, so nothing needs q: one row through it runs at the memory's pace, where XLA:CPU's
    int8 matrix-vector product reaches about half of that on some CPUs (an Intel Xeon; docs/benchmarks.md),
    and the weights take the int8 bytes once instead of twice."""
    return map_weights(params, lambda path, name, w: add_vnni(w) if _is_matrix_int8(w) else w)


def add_vnni(w: Int8Weight) -> Int8Weight:
    """One matrix's forms for the native kernels (add_vnni_weights)."""
    if w.vnni is not None:
        return w
    if supports_vnni(*w.shape):
        return Int8Weight(None, w.scale, _pack_vnni(w.q), w.bf16)
    return Int8Weight(w.q, w.scale, w.vnni, _dequantize_bf16(w)) if w.bf16 is None else w


_pack_int4 = jax.jit(pack_int4, static_argnames="half_scales")
_pack_int5 = jax.jit(pack_int5, static_argnames="half_scales")


def pack_int4_weights(params: Params) -> Params:
    """Replaces every Int4Weight and Int5Weight matrix whose shape the native int4 kernel takes by its
    PackedInt4Weight or PackedInt5Weight, with float16 scales where that changes no value (stacked int4
    expert weights stay as they are)."""

    def pack(path, name: str, w):
        five = isinstance(w, Int5Weight)
        if (_is_matrix_int4(w) or five) and int4_matmul_supports(*w.shape):
            return _consume(_pack_int5 if five else _pack_int4, w, half_scales=exact_in_float16(w))
        return w

    return map_weights(params, pack)


_int5_as_int8 = jax.jit(lambda w: quantize_int8(w.dequantize()))


def int5_as_int8(params: Params) -> Params:
    """Every Int5Weight requantised to int8 per output channel: the form for kernels other than the native
    CPU ones, where no kernel reads 5 bits and XLA would dequantise the weight on every call."""

    def requantize(path, name: str, w):
        return _consume(_int5_as_int8, w) if isinstance(w, Int5Weight) else w

    return map_weights(params, requantize)


def weight_bytes(params: Params) -> int:
    """Bytes held by every weight array (quantised values, scales and kernel copies included)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def quantization_of(params: Params) -> str:
    """ "int4" when any layer weight (stacked experts included) is 4-bit or 5-bit (int4 mode keeps a GGUF
    file's 5-bit blocks too), else "int8" when any is quantised, else "none"."""
    formats = {format_name(w) for layer in params["layers"] for w in layer.values()}
    return "int4" if formats & {"int4", "int5"} else "int8" if "int8" in formats else "none"
