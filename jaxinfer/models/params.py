"""The weights pytree: plain nested dicts of arrays, one layout for every model family.

    params = {
      "embed":      [vocab, hidden]
      "final_norm": [hidden]
      "lm_head":    [vocab, hidden]          # absent when config.tie_word_embeddings
      "layers": [                            # a list, one dict per layer
        {
          "attn_norm":      [hidden]          # norms "pre" and "sandwich"
          "q_proj":         [num_heads * head_dim, hidden]
          "k_proj":         [num_kv_heads * head_dim, hidden]
          "v_proj":         [num_kv_heads * head_dim, hidden]
          "q_bias", "k_bias", "v_bias": [rows of q/k/v_proj]   # qkv_bias only (Qwen 2)
          "o_proj":         [hidden, num_heads * head_dim]
          "q_norm":         [head_dim], or [num_heads * head_dim] for qk_norm "projection"
          "k_norm":         [head_dim], or [num_kv_heads * head_dim]            # qk_norm only
          "post_attn_norm": [hidden]          # norms "sandwich" and "post"
          "mlp_norm":       [hidden]          # norms "pre" and "sandwich"
          "post_mlp_norm":  [hidden]          # norms "sandwich" and "post"
          "gate_proj":      [intermediate, hidden]     # dense MLP
          "up_proj":        [intermediate, hidden]
          "down_proj":      [hidden, intermediate]
          "router":         [experts, hidden]          # mixture of experts instead of the dense MLP
          "expert_gate":    [experts, expert_intermediate, hidden]
          "expert_up":      [experts, expert_intermediate, hidden]
          "expert_down":    [experts, hidden, expert_intermediate]
        }, ...
      ]
    }

Conventions every loader follows:
  * Linear weights are [out_features, in_features] (as Hugging Face and GGUF store them); the model
    computes `x @ w.T`.
  * Q/K rows use the half-split RoPE layout (Hugging Face's `rotate_half`); GGUF Llama files store
    adjacent-pair rows and the GGUF loader un-permutes them.
  * Norm weights are the effective multiplier: Gemma's `(1 + w)` is folded in at load time.
  * A linear weight or table may be quantised: a weight_formats type (Int8Weight, Int4Weight, ...)
    standing for the [out, in] array above (quantization.py says which leaves).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.weight_formats import (
    GROUPED_TYPES,
    Int8Weight,
    concat_rows,
    is_quantized,
    logical_shape,
    quantize_int8,
)

Params = dict[str, Any]


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every leaf of one layer's dict."""
    c = config
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {
        "q_proj": (q_rows, c.hidden_size),
        "k_proj": (kv_rows, c.hidden_size),
        "v_proj": (kv_rows, c.hidden_size),
        "o_proj": (c.hidden_size, q_rows),
    }
    if c.qkv_bias:
        shapes |= {"q_bias": (q_rows,), "k_bias": (kv_rows,), "v_bias": (kv_rows,)}
    if c.qk_norm == "head":
        shapes |= {"q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    elif c.qk_norm == "projection":
        shapes |= {"q_norm": (q_rows,), "k_norm": (kv_rows,)}
    if c.norms in ("pre", "sandwich"):
        shapes |= {"attn_norm": (c.hidden_size,), "mlp_norm": (c.hidden_size,)}
    if c.norms in ("sandwich", "post"):
        shapes |= {"post_attn_norm": (c.hidden_size,), "post_mlp_norm": (c.hidden_size,)}
    if c.num_experts:
        experts, inner = c.num_experts, c.expert_intermediate_size
        shapes |= {
            "router": (experts, c.hidden_size),
            "expert_gate": (experts, inner, c.hidden_size),
            "expert_up": (experts, inner, c.hidden_size),
            "expert_down": (experts, c.hidden_size, inner),
        }
    else:
        shapes |= {
            "gate_proj": (c.intermediate_size, c.hidden_size),
            "up_proj": (c.intermediate_size, c.hidden_size),
            "down_proj": (c.hidden_size, c.intermediate_size),
        }
    return shapes


def top_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every leaf outside the layers."""
    shapes = {"embed": (config.vocab_size, config.hidden_size), "final_norm": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    return shapes


def random_params(config: ModelConfig, seed: int = 0, dtype: str = "float32") -> Params:
    """Random weights with the layout above (for tests and benchmarks of model-shaped programs)."""
    rng = np.random.default_rng(seed)

    def leaf(name: str, shape: tuple[int, ...]) -> jax.Array:
        if name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) * (shape[-1] ** -0.5)
        return jnp.asarray(value, dtype=dtype)

    params: Params = {name: leaf(name, shape) for name, shape in top_shapes(config).items()}
    params["layers"] = [
        {name: leaf(name, shape) for name, shape in layer_shapes(config).items()}
        for _ in range(config.num_layers)
    ]
    return params


def check_params(config: ModelConfig, params: Params) -> None:
    """Raises ValueError when a leaf is missing, extra or of the wrong shape."""
    expected = top_shapes(config)
    got = {k: logical_shape(v) for k, v in params.items() if k != "layers"}
    if got != expected:
        raise ValueError(f"top-level params {got} do not match the config's {expected}")
    if len(params["layers"]) != config.num_layers:
        raise ValueError(f"{len(params['layers'])=} but {config.num_layers=}")
    expected = layer_shapes(config)
    for i, layer in enumerate(params["layers"]):
        got = {k: logical_shape(v) for k, v in layer.items()}
        if got != expected:
            raise ValueError(f"layer {i} params {got} do not match the config's {expected}")


FUSED_PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "qkv_bias": ("q_bias", "k_bias", "v_bias"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fuse_projections(params: Params) -> Params:
    """Concatenates q/k/v rows into "qkv_proj" and gate/up rows into "gate_up_proj" in every layer.

    One matrix-vector product instead of three (or two) per layer: fewer ops per decode step, and a
    larger product runs nearer the memory bandwidth on XLA:CPU than a small one. Works on every weight
    format (per-output-channel and per-group scales concatenate along the rows too). Quantised parts of
    different formats (a GGUF file's 5-bit q and k beside an 8-bit v) fuse as int8: at one row three
    small products cost more than the bytes the narrower formats save. Float parts beside quantised
    ones stay apart. Only for meshes without a tensor axis: a row split of a fused matrix would cut
    across q/k/v.
    """
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        for fused, parts in FUSED_PROJECTIONS.items():
            if not all(p in layer for p in parts):
                continue
            weights = [layer[p] for p in parts]
            if not _same_format(weights) and all(is_quantized(w) for w in weights):
                weights = [w if isinstance(w, Int8Weight) else quantize_int8(w.dequantize()) for w in weights]
            if _same_format(weights):
                layer[fused] = concat_rows(weights)
                for p in parts:
                    del layer[p]
        layers.append(layer)
    return {**params, "layers": layers}


def _same_format(weights: list) -> bool:
    kinds = {(type(w), w.group_size if isinstance(w, GROUPED_TYPES) else None) for w in weights}
    return len(kinds) == 1
