"""Mixtral: the Mistral layer with a sparse mixture-of-experts MLP (top-2 of 8 SiLU-gated experts, the
two routing weights renormalised).

Hugging Face checkpoints store each expert apart (`block_sparse_moe.experts.3.w1.weight`: w1 gate, w3 up,
w2 down); they stack into [experts, out, in] leaves at load. llama.cpp writes Mixtral as its "llama"
architecture with an expert count, Q/K permuted, experts stacked (`ffn_gate_exps.weight`).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.llama import HF_DEFAULTS as LLAMA_DEFAULTS
from jaxinfer.models.llama import llama_fields

# transformers' MixtralConfig defaults for the keys we read.
HF_DEFAULTS = LLAMA_DEFAULTS | {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
    "sliding_window": None,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
}


def _config(cfg: dict[str, Any]) -> ModelConfig:
    return f.build(
        **llama_fields(cfg, "mixtral", window=cfg.get("sliding_window")),
        num_experts=int(cfg["num_local_experts"]),
        experts_per_token=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["intermediate_size"]),
        normalize_expert_weights=True,
    )


FAMILY = f.Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS
    | f.HF_ATTENTION_TENSORS
    | {
        "block_sparse_moe.gate.weight": "router",
        "block_sparse_moe.experts.*.w1.weight": "expert_gate",
        "block_sparse_moe.experts.*.w3.weight": "expert_up",
        "block_sparse_moe.experts.*.w2.weight": "expert_down",
    },
    gguf_archs=("llama",),
    gguf_metadata={"expert_count": "num_local_experts"},
    gguf_permutes_qk=True,
    moe=True,
)
