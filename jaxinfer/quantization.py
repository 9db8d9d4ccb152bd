"""Weight-only int8 quantisation of a params pytree, once, at load or convert time.

Every linear weight [out, in] and the embedding table [vocab, hidden] become {"q": int8 [out, in],
"scale": float32 [out]} (symmetric, one scale per output channel = per vocabulary row for the table,
so the same scales serve the embedding lookup and the tied logits projection). Norms stay float.
Leaves are quantised one at a time on their devices and the float copy is freed at once, so peak
memory stays near one float copy.
"""

from __future__ import annotations

import jax

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

    def convert(tree: dict) -> dict:
        return {
            name: _quantize_leaf(w) if name in QUANTIZED_LEAVES and not is_quantized(w) else w
            for name, w in tree.items()
        }

    top = convert({k: v for k, v in params.items() if k != "layers"})
    top["layers"] = [convert(layer) for layer in params["layers"]]
    return top


def weight_bytes(params: Params) -> int:
    """Bytes held by every weight array (int8 values and their scales included)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def quantization_of(params: Params) -> str:
    return "int8" if any(is_quantized(w) for w in params["layers"][0].values()) else "none"
