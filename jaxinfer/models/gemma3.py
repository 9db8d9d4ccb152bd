"""Gemma 3 (text): sandwich norms, per-head q/k RMSNorm, GELU-tanh MLP, sqrt(hidden) embedding scale,
local sliding-window layers with their own RoPE base between global ones.

Hugging Face stores each norm weight as w for a (1 + w) multiplier; llama.cpp stores the sum. GGUF
files leave out the layer pattern and the local RoPE base (the transformers defaults, every sixth layer
global and base 10000, fill them) and the query scale (head_dim, or hidden / heads for the 27B model,
as llama.cpp computes it).
"""

from __future__ import annotations

import math
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError

# transformers' Gemma3TextConfig defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
}

SANDWICH_TENSORS: dict[str, f.Leaf] = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}


def gemma_fields(cfg: dict[str, Any], family: str, layer_types: list[str]) -> dict[str, Any]:
    """The fields Gemma 2 and 3 share: sandwich norms, GELU-tanh, embedding scale, query scale,
    soft-capping, the local window."""
    shapes = f.shapes(cfg)
    softcap, final_softcap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return dict(
        arch=family,
        **shapes,
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        layer_types=tuple(layer_types),
        activation=f.activation(cfg, family),
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        norms="sandwich",
        embed_scale=math.sqrt(shapes["hidden_size"]),
        attn_logit_softcap=None if softcap is None else float(softcap),
        final_logit_softcap=None if final_softcap is None else float(final_softcap),
    )


def _config(cfg: dict[str, Any]) -> ModelConfig:
    num_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)
        ]
    local_rope = f.rope_parameters(cfg, "sliding_attention")
    if f.rope_scaling_from_hf(local_rope).kind != "default":
        raise ModelLoadError("RoPE scaling on Gemma 3 sliding-window layers is not supported")
    return f.build(
        **gemma_fields(cfg, "gemma3", layer_types),
        **f.global_rope(cfg),
        rope_local_theta=float(local_rope["rope_theta"]),
        qk_norm="head",
    )


LAYERS_27B = 62  # Gemma 3 27B, which llama.cpp scales by hidden / heads


def gguf_query_scale(cfg: dict[str, Any], layers_27b: int | None = None) -> dict[str, Any]:
    """llama.cpp scales Gemma queries by head_dim**-0.5 (query_pre_attn_scalar = head_dim) except for
    the 27B models, whose files it recognises by their layer count (`layers_27b`) and scales by
    (hidden / heads)**-0.5; the files carry no key for it."""
    if layers_27b is not None and int(cfg["num_hidden_layers"]) == layers_27b:
        return {"query_pre_attn_scalar": int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])}
    return {"query_pre_attn_scalar": cfg["head_dim"]}


FAMILY = f.Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=SANDWICH_TENSORS
    | f.HF_ATTENTION_TENSORS
    | f.HF_MLP_TENSORS
    | {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"},
    gguf_archs=("gemma3",),
    gguf_facts=lambda cfg: gguf_query_scale(cfg, layers_27b=LAYERS_27B),
    hf_norm_offset=1.0,
)
