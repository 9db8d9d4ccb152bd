"""Gemma 2: sandwich norms, GELU-tanh MLP, sqrt(hidden) embedding scale, a query scale of its own,
soft-capped attention and final logits, and sliding-window layers alternating with global ones (layer i
is local iff i is even), all on one RoPE base.

Hugging Face stores each norm weight as w for a (1 + w) multiplier; llama.cpp stores the sum. GGUF
files leave out the layer pattern (llama.cpp assumes the same alternation), the RoPE base (10000) and
the query scale (head_dim, or hidden / heads for the 27B models, which llama.cpp recognises by their
46 layers); the soft-caps and the window they carry, with llama.cpp's defaults (the transformers ones)
for files that lack them.
"""

from __future__ import annotations

from typing import Any

from jaxinfer.config import ModelConfig
from jaxinfer.models import family as f
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.gemma3 import SANDWICH_TENSORS, gemma_fields, gguf_query_scale

# transformers' Gemma2Config defaults for the keys we read.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
}
LAYERS_27B = 46  # how llama.cpp tells a Gemma 2 27B file (its query scale is hidden / heads)


def _config(cfg: dict[str, Any]) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise ModelLoadError("gemma2 config.json sets attention_bias=true, which Gemma 2 does not have")
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # transformers' and llama.cpp's pattern: even layers local
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(int(cfg["num_hidden_layers"]))
        ]
    rope = f.global_rope(cfg)
    if rope["rope_scaling"].kind != "default":
        # Every Gemma 2 layer shares one RoPE; our sliding-window layers take theirs unscaled.
        raise ModelLoadError("RoPE scaling on Gemma 2 (local layers included) is not supported")
    return f.build(**gemma_fields(cfg, "gemma2", layer_types), **rope, rope_local_theta=rope["rope_theta"])


def _gguf_facts(cfg: dict[str, Any]) -> dict[str, Any]:
    return gguf_query_scale(cfg, layers_27b=LAYERS_27B)


FAMILY = f.Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    hf_defaults=HF_DEFAULTS,
    config=_config,
    hf_tensors=SANDWICH_TENSORS | f.HF_ATTENTION_TENSORS | f.HF_MLP_TENSORS,
    gguf_archs=("gemma2",),
    gguf_facts=_gguf_facts,
    hf_norm_offset=1.0,
)
