"""What a model family is to jaxinfer: one `Family` value per file of this package.

A family says how its Hugging Face config becomes a ModelConfig (`config`, one builder that the GGUF
loader uses too: loading/gguf_loader.py turns GGUF metadata into the same Hugging Face keys first), where
its tensors go in our params (models/params.py), and the conventions its files follow. Its forward-pass
differences are ModelConfig flags that models/transformer.py reads; no code outside this package branches
on a family's name.

Tensor tables map a name inside one layer ("self_attn.q_proj.weight" after "model.layers.3.", or
"attn_q.weight" after "blk.3.") to a params leaf, or to a tuple of leaves for a fused tensor whose rows
split into them in order (Phi-3's qkv_proj). "experts.*." in a name stands for one expert's slice of a
stacked [experts, ...] leaf (Mixtral's "block_sparse_moe.experts.*.w1.weight").

The builders read Hugging Face key names in both generations of the format:
  * transformers 5 writes `rope_parameters`: one dict ({"rope_type", "rope_theta", scaling fields}), or
    one per layer type for families with local layers ({"full_attention": {...}, "sliding_attention":
    {...}}), and `layer_types`.
  * older files write `rope_theta`, `rope_scaling`, Gemma 3's `rope_local_base_freq` and
    `sliding_window_pattern`.
Keys a file leaves out take the family's transformers class defaults (`hf_defaults`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxinfer.config import ModelConfig, RopeScaling


class ModelLoadError(ValueError):
    """A weights file that is missing, corrupt, or describes something jaxinfer does not support."""


Leaf = str | tuple[str, ...]
SUPPORTED_ROPE_KINDS = ("default", "linear", "llama3")
GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")

# The tensor names llama.cpp writes inside a layer ("blk.N."), for every family that has the tensor.
GGUF_LAYER_TENSORS: dict[str, Leaf] = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_q.bias": "q_bias",
    "attn_k.bias": "k_bias",
    "attn_v.bias": "v_bias",
    "attn_output.weight": "o_proj",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
    "ffn_gate_inp.weight": "router",
    "ffn_gate_exps.weight": "expert_gate",
    "ffn_up_exps.weight": "expert_up",
    "ffn_down_exps.weight": "expert_down",
}

# Hugging Face names inside a layer shared by the Llama-like families.
HF_ATTENTION_TENSORS: dict[str, Leaf] = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
}
HF_MLP_TENSORS: dict[str, Leaf] = {
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
HF_PRE_NORM_TENSORS: dict[str, Leaf] = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its config builder, tensor names and file conventions.

    name: the family, as ModelConfig.arch.
    hf_model_types: config.json `model_type` values it reads.
    hf_defaults: the transformers config class defaults for the keys `config` reads.
    config: a Hugging Face config dict (defaults applied) -> ModelConfig; raises ModelLoadError for
        what jaxinfer does not support.
    hf_tensors: Hugging Face tensor names inside a layer -> leaves.
    gguf_archs: `general.architecture` values llama.cpp writes for it.
    gguf_tensors: GGUF tensor names inside a layer -> leaves.
    gguf_metadata: GGUF keys (after "{arch}.") -> Hugging Face keys, beyond gguf_loader's common ones.
    gguf_facts: Hugging Face keys a GGUF file leaves out, from the keys it has (e.g. Gemma's query
        scale); applied after gguf_metadata.
    gguf_permutes_qk: llama.cpp stores Q/K rows permuted for adjacent-pair RoPE (its "llama" arch).
    moe: a mixture-of-experts family (tells Mixtral from Llama, both "llama" in GGUF files).
    hf_norm_offset: added to every Hugging Face norm weight (Gemma stores w for a (1 + w) multiplier;
        GGUF files hold the sum already).
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_defaults: Mapping[str, Any]
    config: Callable[[dict[str, Any]], ModelConfig]
    hf_tensors: Mapping[str, Leaf]
    gguf_archs: tuple[str, ...] = ()
    gguf_tensors: Mapping[str, Leaf] = dataclasses.field(default_factory=lambda: GGUF_LAYER_TENSORS)
    gguf_metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_facts: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    gguf_permutes_qk: bool = False
    hf_norm_offset: float = 0.0
    moe: bool = False

    def build_config(self, config_dict: Mapping[str, Any]) -> ModelConfig:
        """The ModelConfig for a Hugging Face style config dict; absent keys take hf_defaults."""
        cfg = dict(self.hf_defaults) | dict(config_dict)  # an explicit null stays null
        for flag in ("mlp_bias", "use_bidirectional_attention"):
            if cfg.get(flag):
                raise ModelLoadError(f"config.json sets {flag}=true, which jaxinfer does not support")
        return self.config(cfg)


def shapes(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every family reads from the same Hugging Face keys."""
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


def activation(cfg: Mapping[str, Any], family: str) -> str:
    """Our activation name for the config's gated-MLP activation (`hidden_act` or Gemma's
    `hidden_activation`)."""
    name = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if name == "silu":
        return "silu"
    if name in GELU_TANH_NAMES:
        return "gelu_tanh"
    raise ModelLoadError(f"{family} activation {name!r} is not supported (silu, gelu_pytorch_tanh)")


def global_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling fields for full-attention layers (no scaling on local ones)."""
    rope = rope_parameters(cfg, "full_attention")
    return dict(rope_theta=float(rope["rope_theta"]), rope_scaling=rope_scaling_from_hf(rope))


def uniform_layers(cfg: Mapping[str, Any], window: int | None, num_layers: int) -> dict[str, Any]:
    """sliding_window and layer_types for a family whose window (if any) applies to every layer, unless
    the file lists `layer_types` itself."""
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if window else "full_attention"] * num_layers
    if "sliding_attention" not in layer_types:
        window = None
    return dict(sliding_window=int(window) if window else None, layer_types=tuple(layer_types))


def rope_parameters(cfg: Mapping[str, Any], layer_type: str) -> dict[str, Any]:
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
    scaling = dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))  # older files name it "type"
    return scaling | {"rope_type": kind, "rope_theta": cfg["rope_theta"]}


def rope_scaling_from_hf(rope: Mapping[str, Any]) -> RopeScaling:
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


def build(**fields: Any) -> ModelConfig:
    """ModelConfig(**fields), its ValueError as the ModelLoadError a loader reports."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ModelLoadError(f"the config describes an invalid model: {e}") from e
