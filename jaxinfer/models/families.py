"""Every model family jaxinfer runs, and how a file's config finds its family.

Adding a family: a file in this package with its `FAMILY` (models/family.py), listed here.
"""

from __future__ import annotations

from jaxinfer.models import gemma2, gemma3, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe
from jaxinfer.models.family import Family, ModelLoadError

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    gemma3.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    gemma2.FAMILY,
    olmo2.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
)
BY_NAME = {family.name: family for family in FAMILIES}


def family_named(name: str) -> Family:
    """The family a ModelConfig.arch names."""
    if name not in BY_NAME:
        raise ModelLoadError(f"unknown model family {name!r} (known: {sorted(BY_NAME)})")
    return BY_NAME[name]


def family_for_hf(model_type: str | None) -> Family:
    """The family that reads a config.json with this `model_type`."""
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    supported = sorted(t for family in FAMILIES for t in family.hf_model_types)
    raise ModelLoadError(f"config.json model_type {model_type!r} is not supported (supported: {supported})")


def family_for_gguf(arch: str, num_experts: int = 0) -> Family:
    """The family of a GGUF file's `general.architecture`, told apart by experts where two share one
    (llama.cpp writes Mixtral as "llama" with an expert count)."""
    candidates = [family for family in FAMILIES if arch in family.gguf_archs]
    if candidates:
        return next((c for c in candidates if c.moe == bool(num_experts)), candidates[0])
    supported = sorted(a for family in FAMILIES for a in family.gguf_archs)
    raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
