"""A model's recommended sampling values (request.ModelDefaults), from wherever the model keeps them.

embedded model     its publishers' recommendation (registry.EmbeddedModel.sampling)
Hugging Face       generation_config.json
GGUF file          the general.sampling.* keys llama.cpp's converter writes
orbax checkpoint   what `jaxinfer convert` saved from its source
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.loading.gguf_loader import open_gguf
from jaxinfer.loading.orbax_checkpoint import read_extra
from jaxinfer.registry import EMBEDDED_MODELS
from jaxinfer.request import ModelDefaults

# GGUF key -> request field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(model: str, kind: str, path: Path, gguf_reader=None) -> ModelDefaults:
    """model: the name or path the user gave; (kind, path): what registry.resolve_model made of it."""
    if model in EMBEDDED_MODELS:
        m = EMBEDDED_MODELS[model]
        return ModelDefaults(dict(m.sampling), m.sampling_source)
    if kind == "hf":
        file = Path(path) / "generation_config.json"
        if file.is_file():
            return ModelDefaults.from_generation_config(json.loads(file.read_text()), str(file))
        return ModelDefaults()
    if kind == "orbax":
        saved = read_extra(path).get("sampling_defaults")
        return ModelDefaults(saved["values"], saved["source"]) if saved else ModelDefaults()
    reader = open_gguf(gguf_reader or path)
    values = {}
    for key, name in _GGUF_KEYS.items():
        field = reader.fields.get(key)
        if field is not None:
            value = field.contents()
            values[name] = int(value) if name == "top_k" else float(value)
    return ModelDefaults(values, f"{Path(path).name} general.sampling.*") if values else ModelDefaults()
