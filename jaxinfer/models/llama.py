"""Llama (1, 2, 3, 3.1 RoPE scaling) and the models built on it unchanged: SmolLM2, TinyLlama, ...

Pre-norm decoder layers, SiLU-gated MLP, no biases, grouped-query attention. llama.cpp writes these (and
Mistral and Mixtral) as its "llama" architecture, with Q/K rows permuted for adjacent-pair RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError

# transformers' LlamaConfig defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def llama_fields(cfg: Mapping[str, Any], family: str, window: int | None = None) -> dict[str, Any]:
    """The ModelConfig fields of a Llama-shaped model: shapes, RoPE, SiLU, and `window` (if any) on every
    layer unless the file's `layer_types` says otherwise."""
    shapes = f.shapes(cfg)
    fields = dict(arch=family, **shapes, **f.global_rope(cfg), activation=f.activation(cfg, family))
    fields |= f.uniform_layers(cfg, window, shapes["num_layers"])
    fields["rope_local_theta"] = fields["rope_theta"]
    if fields["sliding_window"] and fields["rope_scaling"].kind != "default":
        raise ModelLoadError("sliding-window layers with RoPE scaling are not supported")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{family} config.json sets attention_bias=true, which {family} does not have")
    return fields


def _config(cfg: dict[str, Any]) -> ModelConfig:
    return f.build(**llama_fields(cfg, "llama"))


FAMILY = f.Family(
    name="llama",
    hf_model_types=("llama", "smollm"),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS | f.HF_ATTENTION_TENSORS | f.HF_MLP_TENSORS,
    gguf_archs=("llama",),
    gguf_permutes_qk=True,
)
