"""The device mesh and the one table that says how every array is partitioned over it.

Mesh axes:
  data   - independent decode slots (the KV cache's slot axis).
  tensor - Megatron-style model parallelism: attention heads and MLP columns.

Weights are [out, in] (see params.py): column-parallel layers split `out`, row-parallel layers split `in`.
Multi-device work changes the rules below, never the model code.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

DATA, TENSOR = "data", "tensor"

# Leaf name -> PartitionSpec of that weight. Unlisted leaves (norms) are replicated.
PARAM_RULES: dict[str, P] = {
    "embed": P(TENSOR, None),  # vocab-parallel
    "lm_head": P(TENSOR, None),  # vocab-parallel logits
    "q_proj": P(TENSOR, None),  # column-parallel
    "k_proj": P(TENSOR, None),
    "v_proj": P(TENSOR, None),
    "gate_proj": P(TENSOR, None),
    "up_proj": P(TENSOR, None),
    "o_proj": P(None, TENSOR),  # row-parallel
    "down_proj": P(None, TENSOR),
}
REPLICATED = P()


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, tensor) mesh; `shape` like {"data": 2, "tensor": 4}. Default: one device."""
    shape = dict(shape or {DATA: 1, TENSOR: 1})
    unknown = set(shape) - {DATA, TENSOR}
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {DATA!r} and {TENSOR!r}")
    dims = (shape.get(DATA, 1), shape.get(TENSOR, 1))
    devices = list(devices if devices is not None else jax.devices())
    needed = dims[0] * dims[1]
    if needed > len(devices):
        raise ValueError(f"mesh {shape} needs {needed} devices, only {len(devices)} available")
    grid = np.array(devices[:needed]).reshape(dims)
    # Auto axis types: let XLA propagate shardings through matmuls (Explicit would need out_sharding= everywhere).
    return Mesh(grid, (DATA, TENSOR), axis_types=(AxisType.Auto, AxisType.Auto))


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,tensor=4' -> {'data': 2, 'tensor': 4}."""
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit() or int(size) < 1:
            raise ValueError(f"bad mesh entry {part!r}: expected NAME=SIZE like 'tensor=4'")
        shape[name.strip()] = int(size)
    return shape


def _fits(spec: P, shape: tuple[int, ...], mesh: Mesh) -> bool:
    for axis, dim in zip(spec, shape):
        if axis is not None and dim % mesh.shape[axis]:
            return False
    return True


def param_spec(key_path: tuple[str | int, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of one weight; replicated when its dims do not divide over the mesh."""
    spec = PARAM_RULES.get(str(key_path[-1]), REPLICATED)
    return spec if _fits(spec, shape, mesh) else REPLICATED


def param_placement(mesh: Mesh):
    """A loader `Placement`: (key_path, shape, dtype) -> NamedSharding."""

    def place(key_path: tuple[str | int, ...], shape: tuple[int, ...], dtype: str) -> NamedSharding:
        del dtype
        return NamedSharding(mesh, param_spec(key_path, shape, mesh))

    return place


def shard_params(params, mesh: Mesh):
    """Places an in-memory params pytree on the mesh following PARAM_RULES."""

    def put(path, leaf):
        key_path = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        return jax.device_put(leaf, NamedSharding(mesh, param_spec(key_path, leaf.shape, mesh)))

    return jax.tree_util.tree_map_with_path(put, params)


def kv_cache_spec(layout: str, num_kv_heads: int, num_slots: int, mesh: Mesh) -> P:
    """Cache arrays are split over slots on `data` and over KV heads on `tensor` (replicated when the heads
    do not divide over `tensor`)."""
    slot_axis = DATA if num_slots % mesh.shape[DATA] == 0 else None
    head_axis = TENSOR if num_kv_heads % mesh.shape[TENSOR] == 0 else None
    if layout == "bhsd":  # [layers, slots, kv_heads, max_len, head_dim]
        return P(None, slot_axis, head_axis, None, None)
    return P(None, slot_axis, None, head_axis, None)  # [layers, slots, max_len, kv_heads, head_dim]


def slot_spec(num_slots: int, mesh: Mesh) -> P:
    """Per-slot state vectors follow the cache's slot split."""
    return P(DATA) if num_slots % mesh.shape[DATA] == 0 else REPLICATED
