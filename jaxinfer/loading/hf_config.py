"""Hugging Face config.json -> ModelConfig, for the Llama family and Gemma 3.

Two generations of the format are read:
  * transformers 5 writes `rope_parameters`: one dict for Llama ({"rope_type", "rope_theta", scaling
    fields}), one dict per layer type for Gemma 3 ({"full_attention": {...}, "sliding_attention": {...}}),
    and `layer_types`.
  * older files write `rope_theta`, `rope_scaling`, Gemma's `rope_local_base_freq` and
    `sliding_window_pattern` (every n-th layer global).
Keys a file leaves out take the transformers class defaults below.
"""

from __future__ import annotations

import math
from typing import Any

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading.common import ModelLoadError

LLAMA_MODEL_TYPES = ("llama", "mistral", "smollm")
GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
SUPPORTED_ROPE_KINDS = ("default", "linear", "llama3")

# The transformers class defaults (LlamaConfig, MistralConfig, Gemma3TextConfig) for the keys we read.
_LLAMA_DEFAULTS: dict[str, Any] = {
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
_MISTRAL_DEFAULTS = _LLAMA_DEFAULTS | {
    "intermediate_size": 14336,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
    "sliding_window": 4096,
}
_GEMMA3_DEFAULTS: dict[str, Any] = {
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
_GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def config_from_hf(config_dict: dict) -> ModelConfig:
    """The ModelConfig for a parsed Hugging Face config.json (Llama family or Gemma 3)."""
    if not isinstance(config_dict, dict):
        raise ValueError(f"{type(config_dict)=} must be a dict parsed from config.json")
    model_type = config_dict.get("model_type")
    if model_type == "gemma3":
        # The multimodal Gemma 3 config nests the language model's config.
        text = config_dict.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError("a gemma3 config.json needs a text_config dict")
        top_level_tie = {k: config_dict[k] for k in ("tie_word_embeddings",) if k in config_dict}
        config_dict = top_level_tie | text | {"model_type": "gemma3_text"}
        model_type = "gemma3_text"
    if model_type in LLAMA_MODEL_TYPES:
        defaults = _MISTRAL_DEFAULTS if model_type == "mistral" else _LLAMA_DEFAULTS
        cfg = _with_defaults(config_dict, defaults)
        return _llama_config(cfg, model_type)
    if model_type == "gemma3_text":
        return _gemma3_config(_with_defaults(config_dict, _GEMMA3_DEFAULTS))
    supported = LLAMA_MODEL_TYPES + GEMMA3_MODEL_TYPES
    raise ModelLoadError(f"config.json model_type {model_type!r} is not supported (supported: {supported})")


def _with_defaults(config_dict: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    cfg = defaults | config_dict  # an explicit null stays null (e.g. Mistral's sliding_window)
    for flag in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
        if cfg.get(flag):
            raise ModelLoadError(f"config.json sets {flag}=true, which jaxinfer does not support")
    return cfg


def _shapes(cfg: dict[str, Any]) -> dict[str, Any]:
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    num_kv_heads = cfg.get("num_key_value_heads") or num_heads
    head_dim = cfg.get("head_dim") or hidden // num_heads
    return dict(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
        name=str(cfg.get("_name_or_path") or cfg["model_type"]),
    )


def _llama_config(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    if cfg["hidden_act"] != "silu":
        raise ModelLoadError(f"{model_type} hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    shapes = _shapes(cfg)
    rope = _rope_parameters(cfg, "full_attention")
    theta, scaling = float(rope["rope_theta"]), rope_scaling_from_hf(rope)
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window") if model_type == "mistral" else None
    if layer_types is None:
        # Mistral applies its window (when set) to every layer; Llama has none.
        kind = "sliding_attention" if window else "full_attention"
        layer_types = [kind] * shapes["num_layers"]
    if "sliding_attention" in layer_types and scaling.kind != "default":
        raise ModelLoadError("sliding-window layers with RoPE scaling are not supported")
    return _build(
        arch="llama",
        **shapes,
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=theta,
        sliding_window=int(window) if window else None,
        layer_types=tuple(layer_types),
        activation="silu",
    )


def _gemma3_config(cfg: dict[str, Any]) -> ModelConfig:
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if activation not in _GELU_TANH_NAMES:
        raise ModelLoadError(f"gemma3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    shapes = _shapes(cfg)
    num_layers = shapes["num_layers"]
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        every = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)
        ]
    global_rope = _rope_parameters(cfg, "full_attention")
    local_rope = _rope_parameters(cfg, "sliding_attention")
    if rope_scaling_from_hf(local_rope).kind != "default":
        raise ModelLoadError("RoPE scaling on Gemma 3 sliding-window layers is not supported")
    softcap, final_softcap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return _build(
        arch="gemma3",
        **shapes,
        rope_theta=float(global_rope["rope_theta"]),
        rope_scaling=rope_scaling_from_hf(global_rope),
        rope_local_theta=float(local_rope["rope_theta"]),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        layer_types=tuple(layer_types),
        activation="gelu_tanh",
        query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        qk_norm=True,
        sandwich_norms=True,
        embed_scale=math.sqrt(shapes["hidden_size"]),
        attn_logit_softcap=None if softcap is None else float(softcap),
        final_logit_softcap=None if final_softcap is None else float(final_softcap),
    )


def _rope_parameters(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """The RoPE dict ({"rope_type", "rope_theta", scaling fields}) that applies to one layer type."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if "full_attention" in params or "sliding_attention" in params:
            params = params.get(layer_type)
            if not isinstance(params, dict):
                raise ModelLoadError(f"config.json rope_parameters has no dict for {layer_type!r}")
        return {"rope_type": "default", "rope_theta": cfg["rope_theta"]} | params
    # Older files: rope_theta + rope_scaling for global layers, rope_local_base_freq for Gemma's local ones.
    if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
        return {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    return {"rope_type": "default"} | (cfg.get("rope_scaling") or {}) | {"rope_theta": cfg["rope_theta"]}


def rope_scaling_from_hf(rope: dict[str, Any]) -> RopeScaling:
    """RopeScaling from a Hugging Face rope dict (`rope_type`, or the older `type`, plus its fields)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    try:
        if kind == "default":
            return RopeScaling()
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(rope["factor"]))
        if kind == "llama3":
            return RopeScaling(
                kind="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
    except KeyError as e:
        raise ModelLoadError(f"{kind} rope scaling lacks {e.args[0]!r}") from e
    raise ModelLoadError(f"rope scaling kind {kind!r} is not supported (supported: {SUPPORTED_ROPE_KINDS})")


def _build(**fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ModelLoadError(f"config.json describes an invalid model: {e}") from e
