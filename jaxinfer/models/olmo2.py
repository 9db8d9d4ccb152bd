"""OLMo 2: the Llama layer with its norms moved after attention and after the MLP, on the branch output
only (no norm before either), and RMSNorm on the whole q and k projections before the head split.

llama.cpp writes it as its "olmo2" architecture: post_attention_norm, post_ffw_norm, attn_q_norm and
attn_k_norm, Q/K rows unpermuted (its RoPE there is the half-split NeoX kind). OLMo 3 files share that
architecture with sliding-window layers, which this family rejects.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.llama import HF_DEFAULTS as LLAMA_DEFAULTS
from jaxinfer.models.llama import llama_fields

# transformers' Olmo2Config defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = LLAMA_DEFAULTS | {"vocab_size": 50304, "rms_norm_eps": 1e-5}


def _config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
        raise ModelLoadError("olmo2 sliding-window layers (OLMo 3) are not supported")
    return f.build(**llama_fields(cfg, "olmo2"), norms="post", qk_norm="projection")


FAMILY = f.Family(
    name="olmo2",
    hf_model_types=("olmo2",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_ATTENTION_TENSORS
    | f.HF_MLP_TENSORS
    | {
        "post_attention_layernorm.weight": "post_attn_norm",
        "post_feedforward_layernorm.weight": "post_mlp_norm",
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
    },
    gguf_archs=("olmo2",),
)
