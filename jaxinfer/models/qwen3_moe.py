"""Qwen3-MoE: the Qwen 3 layer (per-head q/k RMSNorm, no biases) with a sparse mixture-of-experts MLP
(top-k of many small SiLU-gated experts; the k routing weights renormalised only with norm_topk_prob).

Hugging Face checkpoints store each expert apart (`mlp.experts.7.gate_proj.weight`); they stack into
[experts, out, in] leaves at load. llama.cpp's "qwen3moe" files hold them stacked already. Only the
all-sparse layout of the released models is supported (no `mlp_only_layers`, `decoder_sparse_step` 1).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.llama import HF_DEFAULTS as LLAMA_DEFAULTS
from jaxinfer.models.llama import llama_fields

# transformers' Qwen3MoeConfig defaults for the keys we read.
HF_DEFAULTS = LLAMA_DEFAULTS | {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "use_sliding_window": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "moe_intermediate_size": 768,
    "norm_topk_prob": False,
}


def _config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1:
        raise ModelLoadError(
            "qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step) is not supported"
        )
    if cfg.get("use_sliding_window"):
        raise ModelLoadError("qwen3_moe with use_sliding_window=true is not supported")
    # transformers 5 writes the expert count as num_local_experts, the released files as num_experts.
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    return f.build(
        **llama_fields(cfg, "qwen3_moe"),
        qk_norm="head",
        num_experts=int(experts),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        normalize_expert_weights=bool(cfg["norm_topk_prob"]),
    )


def gguf_normalized_routing(cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp renormalises the top-k routing weights of every "qwen3moe" file (the released models set
    norm_topk_prob); the files carry no key for it."""
    return {"norm_topk_prob": True}


FAMILY = f.Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS
    | f.HF_ATTENTION_TENSORS
    | {
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
        "mlp.gate.weight": "router",
        "mlp.experts.*.gate_proj.weight": "expert_gate",
        "mlp.experts.*.up_proj.weight": "expert_up",
        "mlp.experts.*.down_proj.weight": "expert_down",
    },
    gguf_archs=("qwen3moe",),
    gguf_metadata={"expert_count": "num_experts", "expert_feed_forward_length": "moe_intermediate_size"},
    gguf_facts=gguf_normalized_routing,
    moe=True,
)
