"""Weight-only int8 quantisation of a params pytree, once, at load or convert time.

Every linear weight [out, in] and the embedding table [vocab, hidden] become {"q": int8 [out, in],
"scale": float32 [out]} (symmetric, one scale per output channel = per vocabulary row for the table,
so the same scales serve the embedding lookup and the tied logits projection). Norms stay float.
Leaves are quantised one at a time on their devices and the float copy is freed at once, so peak
memory stays near one float copy.

`add_vnni_weights` gives each int8 leaf the same bytes packed for the native VNNI kernel, which serves
products of two or more rows on x86 CPUs with AVX-512 VNNI (cpu_kernels/int8_matmul_vnni.py). Without it,
`add_bf16_copies` gives each int8 leaf a third array, "bf16": the dequantised weight in bfloat16, for
products of more than a few rows on XLA:CPU (kernel_dispatch.ROWS_AS_VECTORS). There the int8 form is
only fast as a matrix-vector product, while a bf16 x bf16 -> f32 dot at 16-512 rows is as fast as an
int8 x int8 one without quantising the activations (measured on SmolLM2's shapes: 16 rows 29.7 vs
29.2 ms, 128 rows 106 vs 135 ms, before the int8 form's outlier handling). It triples the weight
memory of the int8 model (still 75% of f32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.cpu_kernels import pack_weight
from jaxinfer.cpu_kernels import supports as supports_vnni
from jaxinfer.kernel_dispatch import is_quantized
from jaxinfer.params import Params
from pallas_kernels import quantize_int8

QUANTIZED_LEAVES = frozenset(
    {"embed", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    | {"qkv_proj", "gate_up_proj"}  # fused forms (params.fuse_projections)
)
QUANTIZATION_MODES = ("none", "int8")

_quantize = jax.jit(quantize_int8)


def _quantize_leaf(w: jax.Array) -> dict[str, jax.Array]:
    q, scale = _quantize(w)
    w.delete()
    return {"q": q, "scale": scale}


def quantize_params(params: Params, mode: str = "int8") -> Params:
    """Returns params with every linear weight in `mode` ("none" returns params unchanged).

    Consumes `params`: each float leaf is deleted once its int8 form exists.
    """
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {QUANTIZATION_MODES}")
    if mode == "none":
        return params

    return _map_weights(
        params, lambda name, w: _quantize_leaf(w) if name in QUANTIZED_LEAVES and not is_quantized(w) else w
    )


def _map_weights(params: Params, fn) -> Params:
    """params with fn(name, weight) applied to every named weight, top-level and in each layer."""
    top = {name: fn(name, w) for name, w in params.items() if name != "layers"}
    top["layers"] = [{name: fn(name, w) for name, w in layer.items()} for layer in params["layers"]]
    return top


@jax.jit
def _dequantize_bf16(q: jax.Array, scale: jax.Array) -> jax.Array:
    return (q.astype(jnp.float32) * scale[:, None]).astype(jnp.bfloat16)


def add_bf16_copies(params: Params) -> Params:
    """Adds a "bf16" dequantised copy to every int8 weight that lacks one (same sharding as "q")."""

    def copy(name: str, w):
        if is_quantized(w) and "bf16" not in w:
            return {**w, "bf16": _dequantize_bf16(w["q"], w["scale"])}
        return w

    return _map_weights(params, copy)


_pack_vnni = jax.jit(pack_weight)


def add_vnni_weights(params: Params) -> Params:
    """Adds "vnni", the weight packed for the CPU VNNI kernel (cpu_kernels.int8_matmul_vnni), to every
    int8 weight whose shape that kernel takes, and a "bf16" copy to the others: the forms that serve
    products of several rows with KernelConfig(matmul="native"). Packing reorders the int8 bytes, so the
    weights take twice the int8 model's memory (the bf16 copies took three times)."""

    def add(name: str, w):
        if not is_quantized(w) or "vnni" in w:
            return w
        if supports_vnni(*w["q"].shape):
            return {**w, "vnni": _pack_vnni(w["q"])}
        return {**w, "bf16": _dequantize_bf16(w["q"], w["scale"])} if "bf16" not in w else w

    return _map_weights(params, add)


def weight_bytes(params: Params) -> int:
    """Bytes held by every weight array (int8 values and their scales included)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def quantization_of(params: Params) -> str:
    return "int8" if any(is_quantized(w) for w in params["layers"][0].values()) else "none"
