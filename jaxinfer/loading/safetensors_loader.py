"""Hugging Face checkpoints: config.json plus model.safetensors or a sharded model.safetensors.index.json.

The safetensors header is read here directly (8-byte little-endian length, a JSON header, then raw
little-endian data) and each tensor is a view into a read-only memory map, so bfloat16 works without
torch and a tensor costs host memory only while it is being converted.

Gemma 3 checkpoints store every RMSNorm weight as w with the model computing (1 + w); we fold the 1 in
(params hold the effective multiplier). Both text-only (`model.layers...`) and multimodal Gemma 3
(`model.language_model.layers...` / `language_model.model.layers...`) names are accepted; vision
tensors are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.common import KeyPath, LoadedModel, ModelLoadError, ParamsBuilder, Placement
from jaxinfer.loading.hf_config import config_from_hf

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
# Prefixes in front of the language model's own names ("embed_tokens.weight", "layers.3....").
_MODEL_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_COMMON_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
}
_LAYER_TENSORS = {
    "llama": _COMMON_LAYER_TENSORS | {"post_attention_layernorm.weight": "mlp_norm"},
    "gemma3": _COMMON_LAYER_TENSORS
    | {
        "self_attn.q_norm.weight": "q_norm",
        "self_attn.k_norm.weight": "k_norm",
        "post_attention_layernorm.weight": "post_attn_norm",
        "pre_feedforward_layernorm.weight": "mlp_norm",
        "post_feedforward_layernorm.weight": "post_mlp_norm",
    },
}


def load_safetensors(
    directory: str | Path,
    *,
    dtype: str = "float32",
    placement: Placement | None = None,
) -> LoadedModel:
    """Reads a Hugging Face checkpoint folder (single-file or sharded), one tensor at a time."""
    directory = Path(directory).expanduser()
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} has no config.json")
    try:
        config_dict = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
    config = config_from_hf(config_dict)
    builder = ParamsBuilder(config, dtype=dtype, placement=placement)
    for file in safetensors_files(directory):
        for name, value in read_safetensors(file):
            key_path = hf_key_path(name, config)
            if key_path is None:
                continue
            if config.arch == "gemma3" and key_path[-1].endswith("norm"):
                value = value.astype(np.float32) + np.float32(1.0)  # a small fresh array; no aliasing needed
            builder.put(key_path, value, source=f"{file.name}:{name}")
    return LoadedModel(config=config, params=builder.finish(), kind="hf", path=directory)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a checkpoint folder: the shards named by the index, or the single file."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index_path} is not a valid safetensors index: {e!r}") from e
        files = [directory / name for name in names]
    elif (directory / SINGLE_FILE).is_file():
        files = [directory / SINGLE_FILE]
    else:
        raise ModelLoadError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"the safetensors index names {file.name}, which is missing")
    return files


def read_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (name, read-only array view) for each tensor of one .safetensors file, in file order."""
    file_size = path.stat().st_size
    with path.open("rb") as f:
        length_bytes = f.read(8)
        if len(length_bytes) < 8:
            raise ModelLoadError(f"{path} is too short to be a safetensors file")
        header_len = int.from_bytes(length_bytes, "little")
        if header_len > file_size - 8:
            raise ModelLoadError(f"{path} header length {header_len} exceeds the file size {file_size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"{path} has a corrupt safetensors header: {e}") from e
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    data = np.memmap(path, dtype=np.uint8, mode="r") if file_size > data_start else np.zeros(0, np.uint8)
    try:
        entries = sorted(
            (
                int(info["data_offsets"][0]),
                name,
                str(info["dtype"]),
                tuple(int(d) for d in info["shape"]),
                int(info["data_offsets"][1]),
            )
            for name, info in header.items()
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ModelLoadError(f"{path} has a corrupt safetensors header entry: {e!r}") from e
    for begin, name, dtype_name, shape, end in entries:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise ModelLoadError(f"{path.name}:{name} has dtype {dtype_name}, not one of {list(_DTYPES)}")
        begin, end = data_start + begin, data_start + end
        if end - begin != int(np.prod(shape)) * dtype.itemsize or end > file_size:
            raise ModelLoadError(f"{path.name}:{name} has data offsets that do not fit its shape or the file")
        yield name, data[begin:end].view(dtype).reshape(shape)


def hf_key_path(name: str, config: ModelConfig) -> KeyPath | None:
    """Where a Hugging Face tensor goes in our params; None for tensors we skip."""
    if name in _LM_HEAD_NAMES:
        return None if config.tie_word_embeddings else ("lm_head",)
    if name.startswith(_SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    inner = next((name[len(p) :] for p in _MODEL_PREFIXES if name.startswith(p)), None)
    if inner == "embed_tokens.weight":
        return ("embed",)
    if inner == "norm.weight":
        return ("final_norm",)
    match = _LAYER_NAME.fullmatch(inner or "")
    if match and match.group(2) in _LAYER_TENSORS[config.arch]:
        return ("layers", int(match.group(1)), _LAYER_TENSORS[config.arch][match.group(2)])
    raise ModelLoadError(f"tensor {name!r} has no place in the {config.arch} params")
