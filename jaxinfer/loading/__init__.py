"""Weight loading: GGUF files, Hugging Face safetensors folders and jaxinfer's own orbax checkpoints.

Every loader returns a LoadedModel whose params follow jaxinfer/models/params.py, placed leaf by leaf with a
`Placement` (default: everything on the first device), and raises ModelLoadError for files it cannot use.
"""

from __future__ import annotations

from pathlib import Path

from jaxinfer.loading.common import LoadedModel, ModelLoadError, Placement
from jaxinfer.loading.gguf_loader import config_from_gguf, load_gguf
from jaxinfer.loading.hf_config import config_from_hf
from jaxinfer.loading.orbax_checkpoint import (
    config_from_dict,
    config_to_dict,
    load_checkpoint,
    read_extra,
    save_checkpoint,
)
from jaxinfer.loading.safetensors_loader import load_safetensors
from jaxinfer.registry import resolve_model

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "Placement",
    "config_from_dict",
    "config_from_gguf",
    "config_from_hf",
    "config_to_dict",
    "load_checkpoint",
    "load_gguf",
    "load_model",
    "load_safetensors",
    "read_extra",
    "save_checkpoint",
]


def load_model(
    name_or_path: str | Path, *, dtype: str = "float32", placement: Placement | None = None
) -> LoadedModel:
    """Loads an embedded model by name, a .gguf file, a Hugging Face folder or a jaxinfer orbax folder.

    Unknown names and paths raise the registry's ModelNotFoundError (a ValueError).
    """
    kind, path = resolve_model(str(name_or_path))
    if kind == "gguf":
        return load_gguf(path, dtype=dtype, placement=placement)
    if kind == "hf":
        return load_safetensors(path, dtype=dtype, placement=placement)
    if kind == "orbax":
        return load_checkpoint(path, dtype=dtype, placement=placement)
    raise ModelLoadError(f"the registry returned an unknown kind {kind!r} for {name_or_path!r}")
