"""What every weight loader shares: the result type, the error type, placement and a streaming params builder.

A loader walks its file tensor by tensor. For each tensor it produces one host (numpy) array in our layout
(see jaxinfer/models/params.py), hands it to `ParamsBuilder.put`, which casts it, places it on its device with
`jax.device_put` and forgets the host copy. Peak host memory therefore stays near one tensor plus whatever
the file format itself keeps mapped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.models.family import ModelLoadError
from jaxinfer.models.params import Params, check_params, layer_shapes, top_shapes
from jaxinfer.weight_formats import logical_shape

# A leaf's position in the params pytree: ("embed",) or ("layers", 3, "q_proj").
KeyPath = tuple[str | int, ...]
# Called as placement(key_path, shape, dtype_name) for every leaf; returns where that leaf lives.
Placement = Callable[[KeyPath, tuple[int, ...], str], jax.sharding.Sharding]
LoadKind = Literal["gguf", "hf", "orbax"]

# Weight dtypes a loader can produce; norms and everything else are cast to the same dtype.
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
_HOST_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: Params
    kind: LoadKind
    path: Path


def check_dtype(dtype: str) -> np.dtype:
    """The numpy dtype for a supported weight dtype name (bfloat16 comes from ml_dtypes via jax)."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{dtype=} is not one of {SUPPORTED_DTYPES}")
    return np.dtype(jax.numpy.dtype(dtype))


def default_placement() -> Placement:
    """Every leaf on the first device."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return lambda key_path, shape, dtype: sharding


def expected_leaf_shapes(config: ModelConfig) -> dict[KeyPath, tuple[int, ...]]:
    """Shape of every leaf the config implies, keyed by its path in the params pytree."""
    shapes: dict[KeyPath, tuple[int, ...]] = {(name,): shape for name, shape in top_shapes(config).items()}
    per_layer = layer_shapes(config)
    for i in range(config.num_layers):
        shapes |= {("layers", i, name): shape for name, shape in per_layer.items()}
    return shapes


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty at a 64-byte boundary: XLA:CPU aliases a host buffer (no copy) only when so aligned."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _HOST_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def key_path_str(key_path: KeyPath) -> str:
    return ".".join(str(k) for k in key_path)


class ParamsBuilder:
    """Collects leaves one at a time, placing each on its device as soon as it arrives.

    Usage: `builder.put(key_path, host_array, source=...)` for every tensor, then `builder.finish()`.
    `put` checks the shape against the config, `finish` checks that nothing is missing.
    """

    def __init__(self, config: ModelConfig, *, dtype: str, placement: Placement | None):
        self.config = config
        self.dtype_name = dtype
        self.np_dtype = check_dtype(dtype)
        self.placement = placement or default_placement()
        self._expected = expected_leaf_shapes(config)
        self._leaves: dict[KeyPath, jax.Array] = {}
        self._experts: dict[KeyPath, tuple[np.ndarray, set[int]]] = {}

    def _check(self, key_path: KeyPath, shape: tuple[int, ...], source: str) -> tuple[int, ...]:
        expected = self._expected.get(key_path)
        if expected is None:
            raise ModelLoadError(
                f"tensor {source!r} maps to {key_path_str(key_path)}, absent from this config"
            )
        if key_path in self._leaves:
            raise ModelLoadError(f"tensor {source!r} gives {key_path_str(key_path)} a second time")
        if shape != expected:
            raise ModelLoadError(
                f"tensor {source!r} has shape {shape} but {key_path_str(key_path)} needs {expected} "
                "for this config"
            )
        return expected

    def put(self, key_path: KeyPath, value: np.ndarray, *, source: str, owned: bool = False) -> None:
        """Casts `value` to the target dtype and puts it on the device chosen by the placement.

        owned: `value` is a fresh array nobody else will touch, so the device array may alias it (on
        CPU `jax.device_put` then skips a copy when it is 64-byte aligned; see `aligned_empty`).
        """
        expected = self._check(key_path, tuple(value.shape), source)
        if owned and value.dtype == self.np_dtype:
            host = value
        else:
            # XLA:CPU aliases any 64-byte-aligned numpy array, even with may_alias=False (measured with
            # jax 0.10.2), so a view of a memory-mapped file must be copied here, not by device_put.
            host = aligned_empty(value.shape, self.np_dtype)
            host[...] = value
        sharding = self.placement(key_path, expected, self.dtype_name)
        self._leaves[key_path] = jax.device_put(host, sharding, may_alias=True)

    def put_rows(self, key_paths: tuple[KeyPath, ...], value: np.ndarray, *, source: str) -> None:
        """A fused tensor (Phi-3's qkv_proj) whose rows split, in order, into the leaves `key_paths`."""
        sizes = [self._expected.get(k, (0,))[0] for k in key_paths]
        if sum(sizes) != value.shape[0]:
            names = ", ".join(key_path_str(k) for k in key_paths)
            raise ModelLoadError(f"tensor {source!r} has {value.shape[0]} rows, not {sum(sizes)} ({names})")
        for key_path, start, size in zip(key_paths, np.cumsum([0, *sizes]), sizes):
            self.put(key_path, value[start : start + size], source=source)

    def put_expert(self, key_path: KeyPath, expert: int, value: np.ndarray, *, source: str) -> None:
        """One expert's slice [out, in] of a stacked [experts, out, in] leaf (checkpoints that store each
        expert apart); the leaf is placed once every expert has arrived."""
        expected = self._expected.get(key_path)
        if expected is None or len(expected) != 3:
            raise ModelLoadError(f"tensor {source!r} maps to {key_path_str(key_path)}, not an expert weight")
        if not 0 <= expert < expected[0] or tuple(value.shape) != expected[1:]:
            raise ModelLoadError(
                f"tensor {source!r} (expert {expert}, shape {value.shape}) does not fit "
                f"{key_path_str(key_path)} {expected}"
            )
        stacked, seen = self._experts.setdefault(key_path, (aligned_empty(expected, self.np_dtype), set()))
        if expert in seen:
            raise ModelLoadError(f"tensor {source!r} gives expert {expert} of {key_path_str(key_path)} twice")
        stacked[expert] = value
        seen.add(expert)
        if len(seen) == expected[0]:
            del self._experts[key_path]
            self.put(key_path, stacked, source=source, owned=True)

    def put_quantized(self, key_path: KeyPath, weight, *, source: str) -> None:
        """Places a weight_formats type holding host (numpy) arrays, each array as it is (no cast), with
        the placement of its field's path (e.g. ("layers", 0, "q_proj", "scale"))."""
        self._check(key_path, logical_shape(weight), source)

        def place(path, value: np.ndarray) -> jax.Array:
            field = path[-1].name
            host = aligned_empty(value.shape, value.dtype)
            host[...] = value
            sharding = self.placement((*key_path, field), tuple(value.shape), value.dtype.name)
            return jax.device_put(host, sharding, may_alias=True)

        self._leaves[key_path] = jax.tree_util.tree_map_with_path(place, weight)

    def finish(self) -> Params:
        missing = [key_path_str(k) for k in self._expected if k not in self._leaves]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"the weights lack {len(missing)} tensors the config needs: {shown}")
        params: Params = {}
        layers: list[dict[str, jax.Array]] = [{} for _ in range(self.config.num_layers)]
        for key_path in self._expected:  # the canonical leaf order, whatever order the file had
            leaf = self._leaves[key_path]
            if key_path[0] == "layers":
                layers[key_path[1]][key_path[2]] = leaf
            else:
                params[key_path[0]] = leaf
        params["layers"] = layers
        check_params(self.config, params)
        return params
