"""Phi-3 (Phi-3-mini-4k, Phi-3-medium-4k, Phi-4): the Llama layer with fused projections, and the
config's `sliding_window` (if any) on every layer, as transformers applies it.

Hugging Face stores `self_attn.qkv_proj` (rows q, k, v) and `mlp.gate_up_proj` (rows gate, then up), and
llama.cpp the same rows as attn_qkv and ffn_up; both split into our q/k/v and gate/up leaves. llama.cpp
writes Q/K rows unpermuted and the window as attention.sliding_window (0 for none); it currently runs
Phi-3 without the window (llama.cpp#13676), where we keep transformers' behaviour for both formats.

Not supported: LongRoPE ("longrope", formerly "su"; the 128k-context Phi-3 and Phi-3.5 models), whose
frequencies switch with the sequence length, and partial rotary embeddings (Phi-4-mini).
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.llama import llama_fields

# transformers' Phi3Config defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "sliding_window": None,
}
LONGROPE_NAMES = ("longrope", "su", "yarn")  # transformers reads Phi-3's "su" and "yarn" as "longrope"


def _config(cfg: dict[str, Any]) -> ModelConfig:
    rope = f.rope_parameters(cfg, "full_attention")
    kinds = {rope.get("rope_type"), rope.get("type")}  # older files name it `type`
    if kinds & set(LONGROPE_NAMES):
        raise ModelLoadError(
            "phi3 LongRoPE scaling (rope type 'longrope'/'su': the 128k-context Phi-3 and Phi-3.5 models) "
            "is not supported"
        )
    rotary = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise ModelLoadError(f"phi3 partial_rotary_factor={rotary} (partial RoPE) is not supported")
    return f.build(**llama_fields(cfg, "phi3", window=cfg.get("sliding_window")))


def gguf_longrope(cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp writes rope.scaling.attn_factor (read as `attention_factor`, LongRoPE's key) only with
    LongRoPE's factor tensors: the file then says which scaling it needs."""
    if "attention_factor" in cfg:
        return {"rope_scaling": {"rope_type": "longrope", "attention_factor": cfg["attention_factor"]}}
    return {}


FAMILY = f.Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS
    | {
        "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
        "self_attn.o_proj.weight": "o_proj",
        "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
        "mlp.down_proj.weight": "down_proj",
    },
    gguf_archs=("phi3",),
    gguf_tensors=f.GGUF_LAYER_TENSORS
    | {"attn_qkv.weight": ("q_proj", "k_proj", "v_proj"), "ffn_up.weight": ("gate_proj", "up_proj")},
    gguf_metadata={"rope.scaling.attn_factor": "attention_factor"},
    gguf_facts=gguf_longrope,
)
