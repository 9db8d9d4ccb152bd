"""Qwen2 and Qwen2.5: the Llama layer with biases on the q, k and v projections (none on o_proj); the small
models tie the embeddings.

transformers applies a sliding window only when `use_sliding_window` is true, and then only on the layers
from `max_window_layers` on (unless the file lists `layer_types` itself); the released models set it false.
llama.cpp's "qwen2" architecture has no sliding window (a window in its metadata is ignored, as here without
`use_sliding_window`) and stores Q/K rows unpermuted, the biases as attn_q.bias, attn_k.bias, attn_v.bias.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.llama import llama_fields

# transformers' Qwen2Config defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}

QKV_BIAS_TENSORS: dict[str, f.Leaf] = {
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
}


def qwen_fields(cfg: Mapping[str, Any], family: str) -> dict[str, Any]:
    """The Llama fields with Qwen's window rule: `sliding_window` counts only with `use_sliding_window`,
    and then on layers i >= max_window_layers (transformers' Qwen2Config/Qwen3Config), unless the file lists
    `layer_types`. `attention_bias` is the caller's to check (Qwen 2 has its biases regardless)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        first_local = int(cfg["max_window_layers"])
        layer_types = [
            "sliding_attention" if window is not None and i >= first_local else "full_attention"
            for i in range(int(cfg["num_hidden_layers"]))
        ]
    cfg = {k: v for k, v in cfg.items() if k != "attention_bias"} | {"layer_types": layer_types}
    return llama_fields(cfg, family, window)


def _config(cfg: dict[str, Any]) -> ModelConfig:
    return f.build(**qwen_fields(cfg, "qwen2"), qkv_bias=True)


FAMILY = f.Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS | f.HF_ATTENTION_TENSORS | QKV_BIAS_TENSORS | f.HF_MLP_TENSORS,
    gguf_archs=("qwen2",),
)
