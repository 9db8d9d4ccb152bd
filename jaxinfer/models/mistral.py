"""Mistral: the Llama layer with a sliding attention window on every layer (when the config sets one;
Mistral 7B v0.2 and later set none).

llama.cpp writes Mistral as its "llama" architecture, without the window; the llama family reads those.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.llama import HF_DEFAULTS as LLAMA_DEFAULTS
from jaxinfer.models.llama import llama_fields

HF_DEFAULTS = LLAMA_DEFAULTS | {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}


def _config(cfg: dict[str, Any]) -> ModelConfig:
    return f.build(**llama_fields(cfg, "mistral", window=cfg.get("sliding_window")))


FAMILY = f.Family(
    name="mistral",
    hf_model_types=("mistral",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=f.HF_PRE_NORM_TENSORS | f.HF_ATTENTION_TENSORS | f.HF_MLP_TENSORS,
)
