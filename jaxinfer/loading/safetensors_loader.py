"""Hugging Face checkpoints: config.json plus model.safetensors or a sharded model.safetensors.index.json.

The safetensors header is read here directly (8-byte little-endian length, a JSON header, then raw
little-endian data) and each tensor is a view into a read-only memory map, so bfloat16 works without
torch and a tensor costs host memory only while it is being converted.

Tensor names and conventions come from the model's family (models/): Gemma checkpoints store every
RMSNorm weight as w with the model computing (1 + w), and we fold the 1 in (params hold the effective
multiplier); fused tensors split into their leaves; experts stored one by one stack into one leaf. Both
text-only (`model.layers...`) and multimodal (`model.language_model.layers...` /
`language_model.model.layers...`) names are accepted; vision tensors are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.common import LoadedModel, ModelLoadError, ParamsBuilder, Placement
from jaxinfer.loading.hf_config import config_from_hf
from jaxinfer.models.families import family_named

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
_EXPERT_NAME = re.compile(r"(.*experts\.)(\d+)(\..+)")  # "mlp.experts.7.up_proj.weight"


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
    family = family_named(config.arch)
    builder = ParamsBuilder(config, dtype=dtype, placement=placement)
    for file in safetensors_files(directory):
        for name, value in read_safetensors(file):
            place = hf_key_path(name, config)
            if place is None:
                continue
            key_path, expert = place
            source = f"{file.name}:{name}"
            if family.hf_norm_offset and key_path[-1].endswith("norm"):
                value = value.astype(np.float32) + np.float32(family.hf_norm_offset)  # small and fresh
            if isinstance(key_path[-1], tuple):
                builder.put_rows(tuple((*key_path[:-1], leaf) for leaf in key_path[-1]), value, source=source)
            elif expert is not None:
                builder.put_expert(key_path, expert, value, source=source)
            else:
                builder.put(key_path, value, source=source)
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


def hf_key_path(name: str, config: ModelConfig) -> tuple[tuple, int | None] | None:
    """Where a Hugging Face tensor goes in our params: (key path, expert index or None), the key path's
    last entry a tuple of leaves for a fused tensor; None for tensors we skip."""
    if name in _LM_HEAD_NAMES:
        return None if config.tie_word_embeddings else (("lm_head",), None)
    if name.startswith(_SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq"):
        return None
    inner = next((name[len(p) :] for p in _MODEL_PREFIXES if name.startswith(p)), None)
    if inner == "embed_tokens.weight":
        return ("embed",), None
    if inner == "norm.weight":
        return ("final_norm",), None
    match = _LAYER_NAME.fullmatch(inner or "")
    if match:
        tensors, suffix, expert = family_named(config.arch).hf_tensors, match.group(2), None
        expert_match = _EXPERT_NAME.fullmatch(suffix)
        if expert_match and suffix not in tensors:
            suffix = expert_match.group(1) + "*" + expert_match.group(3)
            expert = int(expert_match.group(2))
        if suffix in tensors:
            return ("layers", int(match.group(1)), tensors[suffix]), expert
    raise ModelLoadError(f"tensor {name!r} has no place in the {config.arch} params")
