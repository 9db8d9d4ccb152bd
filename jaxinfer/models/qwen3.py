"""Qwen3 (dense): the Llama layer with per-head RMSNorm on queries and keys before RoPE, an explicit
head_dim (128 in the released models, not hidden / heads), no biases; sliding window as Qwen2's.

`attention_bias=true` puts biases on q, k, v and o_proj in transformers; o_proj has no bias leaf here,
so it is refused. llama.cpp's "qwen3" architecture stores Q/K rows unpermuted, the norms as attn_q_norm and
attn_k_norm, and has no sliding window.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.qwen2 import HF_DEFAULTS as QWEN2_DEFAULTS
from jaxinfer.models.qwen2 import qwen_fields

# transformers' Qwen3Config defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = QWEN2_DEFAULTS | {"head_dim": 128, "attention_bias": False}


def _config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise ModelLoadError(
            "qwen3 config.json sets attention_bias=true (biases on q/k/v and o_proj); a bias on o_proj is "
            "not supported"
        )
    return f.build(**qwen_fields(cfg, "qwen3"), qk_norm="head")


FAMILY = f.Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS
    | f.HF_ATTENTION_TENSORS
    | f.HF_MLP_TENSORS
    | {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"},
    gguf_archs=("qwen3",),
)
