"""Every model family jaxinfer runs, and how a file's config finds its family.

Adding a family: a file in this package with its `FAMILY` (models/family.py), listed here.
"""

from __future__ import annotations

from jaxinfer.loading.common import ModelLoadError
from jaxinfer.models import gemma3, llama, mistral
from jaxinfer.models.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, mistral.FAMILY, gemma3.FAMILY)
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
    """The family of a GGUF file's `general.architecture`; llama.cpp writes Mixtral as "llama" with
    experts."""
    if arch == "llama" and num_experts and "mixtral" in BY_NAME:
        return BY_NAME["mixtral"]
    for family in FAMILIES:
        if arch in family.gguf_archs:
            return family
    supported = sorted(a for family in FAMILIES for a in family.gguf_archs)
    raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
