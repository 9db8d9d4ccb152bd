"""jaxinfer's own checkpoint folder: the config as JSON next to the params saved with orbax.

    <directory>/
      jaxinfer_model.json   {"format", "version", "config": config_to_dict(config), "dtype",
                             "quantization", "weight_formats": {leaf path: weight_formats.describe(leaf)}
                             for every quantised leaf, "extra"}
      params/               orbax StandardCheckpointer output (the params pytree)
      tokenizer/            (written by the tokenizer code, not here)

The JSON file is written last, so a folder the registry recognises (by jaxinfer_model.json) always has
complete params. Restoring builds `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` targets from the
config, so orbax reads every array straight into its final sharding (and casts when dtype differs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading.common import (
    LoadedModel,
    ModelLoadError,
    Placement,
    check_dtype,
    default_placement,
    expected_leaf_shapes,
)
from jaxinfer.models.params import Params, check_params
from jaxinfer.quantization import map_weights, quantization_of
from jaxinfer.weight_formats import abstract_weight, describe, is_quantized

MODEL_FILE = "jaxinfer_model.json"
PARAMS_DIR = "params"
FORMAT = "jaxinfer-orbax"
VERSION = 2  # 2: quantised leaves are weight_formats types, described per leaf


def config_to_dict(config: ModelConfig) -> dict:
    """A JSON-ready dict of every ModelConfig field (rope_scaling nested, layer_types a list)."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"{type(config)=} must be a ModelConfig")
    d = dataclasses.asdict(config)
    d["layer_types"] = list(d["layer_types"])
    return d


def config_from_dict(d: dict) -> ModelConfig:
    """Inverse of config_to_dict; unknown keys raise ValueError (a newer or foreign file)."""
    if not isinstance(d, dict):
        raise ValueError(f"{type(d)=} must be a dict")
    d = dict(d)
    # Checkpoints written before norm placement and q/k norms had kinds held them as two booleans.
    if isinstance(d.get("qk_norm"), bool):
        d["qk_norm"] = "head" if d["qk_norm"] else "none"
    if "sandwich_norms" in d:
        d["norms"] = "sandwich" if d.pop("sandwich_norms") else "pre"
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"config dict has unknown fields {unknown}")
    fields = dict(d)
    if isinstance(fields.get("rope_scaling"), dict):
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    if "layer_types" in fields:
        fields["layer_types"] = tuple(fields["layer_types"])
    return ModelConfig(**fields)


def save_checkpoint(
    directory: str | Path,
    config: ModelConfig,
    params: Params,
    *,
    extra: dict | None = None,
    overwrite: bool = False,
) -> None:
    """Writes params (orbax) and config + `extra` (JSON) into `directory`, creating it if needed."""
    import orbax.checkpoint as ocp  # heavy import; only checkpoint users pay for it

    check_params(config, params)
    formats: dict[str, dict] = {}

    def note_format(path: tuple, name: str, w):
        if is_quantized(w):
            formats[".".join(map(str, path))] = describe(w)
        return w

    map_weights(params, note_format)
    # The dtype recorded is that of the float leaves (norms, unquantised weights).
    float_leaves = [w for w in jax.tree.leaves(params, is_leaf=is_quantized) if not is_quantized(w)]
    dtypes = {str(leaf.dtype) for leaf in float_leaves}
    if len(dtypes) != 1:
        raise ValueError(f"params mix float dtypes {sorted(dtypes)}; save one dtype")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"{type(extra)=} must be a dict or None")
    directory = Path(directory).expanduser().resolve()
    model_file = directory / MODEL_FILE
    if model_file.exists() or (directory / PARAMS_DIR).exists():
        if not overwrite:
            raise ValueError(f"{directory} already holds a checkpoint; pass overwrite=True to replace it")
        model_file.unlink(missing_ok=True)  # the folder stops looking complete until we are done
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "format": FORMAT,
        "version": VERSION,
        "config": config_to_dict(config),
        "dtype": dtypes.pop(),
        "quantization": quantization_of(params),
        "weight_formats": formats,
        "extra": extra or {},
    }
    text = json.dumps(record, indent=2)  # fail on a non-JSON `extra` before writing anything
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / PARAMS_DIR, params, force=overwrite)
        checkpointer.wait_until_finished()
    tmp = directory / (MODEL_FILE + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, model_file)


def read_model_file(directory: str | Path) -> dict[str, Any]:
    """The parsed jaxinfer_model.json of a checkpoint folder, validated."""
    model_file = Path(directory).expanduser() / MODEL_FILE
    if not model_file.is_file():
        raise ModelLoadError(f"{model_file} does not exist")
    try:
        record = json.loads(model_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{model_file} is not valid JSON: {e}") from e
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ModelLoadError(f"{model_file} is not a {FORMAT} file")
    if record.get("version") != VERSION:
        version = record.get("version")
        raise ModelLoadError(f"{model_file} has version {version!r}; this jaxinfer reads {VERSION}")
    return record


def load_checkpoint(
    directory: str | Path,
    *,
    dtype: str | None = None,
    placement: Placement | None = None,
) -> LoadedModel:
    """Restores a save_checkpoint folder, each array straight into placement's sharding.

    dtype None keeps the saved dtype; otherwise orbax casts while restoring.
    """
    import orbax.checkpoint as ocp

    directory = Path(directory).expanduser().resolve()
    record = read_model_file(directory)
    try:
        config = config_from_dict(record["config"])
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{directory / MODEL_FILE} holds an invalid config: {e}") from e
    dtype_name = str(record.get("dtype", "float32")) if dtype is None else dtype
    np_dtype = check_dtype(dtype_name) if dtype is not None else np.dtype(jax.numpy.dtype(dtype_name))
    placement = placement or default_placement()
    formats = record.get("weight_formats") or {}
    if not isinstance(formats, dict):
        raise ModelLoadError(f"{directory / MODEL_FILE}: weight_formats must be an object")

    targets: Params = {"layers": [{} for _ in range(config.num_layers)]}
    for key_path, shape in expected_leaf_shapes(config).items():
        description = formats.get(
            ".".join(map(str, key_path[1:] if key_path[0] == "layers" else key_path)), {}
        )

        def target_for(field, shape, dtype, key_path=key_path):
            path = (*key_path, field) if field else key_path
            return jax.ShapeDtypeStruct(shape, dtype, sharding=placement(path, shape, np.dtype(dtype).name))

        try:
            target = abstract_weight(description, shape, target_for, np_dtype)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{directory / MODEL_FILE}: bad format for {key_path}: {e}") from e
        if key_path[0] == "layers":
            targets["layers"][key_path[1]][key_path[2]] = target
        else:
            targets[key_path[0]] = target
    params_dir = directory / PARAMS_DIR
    if not params_dir.is_dir():
        raise ModelLoadError(f"{params_dir} does not exist")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(params_dir, targets)
    except Exception as e:  # orbax/tensorstore raise many types for a damaged or mismatched folder
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"cannot restore {params_dir}: {first_line}") from e
    return LoadedModel(config=config, params=params, kind="orbax", path=directory)


def read_extra(directory: str | Path) -> dict:
    """The `extra` dict saved with a checkpoint."""
    return dict(read_model_file(directory).get("extra") or {})
