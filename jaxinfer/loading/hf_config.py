"""Hugging Face config.json -> ModelConfig, through the family its `model_type` names (models/families.py)."""

from __future__ import annotations

from jaxinfer.config import ModelConfig
from jaxinfer.loading.common import ModelLoadError
from jaxinfer.models.families import family_for_hf


def config_from_hf(config_dict: dict) -> ModelConfig:
    """The ModelConfig for a parsed Hugging Face config.json."""
    if not isinstance(config_dict, dict):
        raise ValueError(f"{type(config_dict)=} must be a dict parsed from config.json")
    return family_for_hf(config_dict.get("model_type")).build_config(text_config(config_dict))


def text_config(config_dict: dict) -> dict:
    """The language model's config: multimodal Gemma 3 files nest it under `text_config`."""
    if config_dict.get("model_type") != "gemma3":
        return config_dict
    text = config_dict.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError("a gemma3 config.json needs a text_config dict")
    top_level_tie = {k: config_dict[k] for k in ("tie_word_embeddings",) if k in config_dict}
    return top_level_tie | text | {"model_type": "gemma3_text"}
