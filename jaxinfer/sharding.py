"""The device mesh and the one table that says how every array is partitioned over it.

Mesh axes:
  data   - independent decode slots (the KV cache's slot axis).
  expert - expert parallelism: a mixture-of-experts layer's experts split over devices.
  tensor - Megatron-style model parallelism: attention heads and MLP columns (within each expert too).

Weights are [out, in] (see models/params.py): column-parallel layers split `out`, row-parallel layers
split `in`; stacked expert weights [experts, out, in] split `experts` over `expert` as well.
A quantised weight (weight_formats.py) follows its layer's rule in each of its arrays: int8 q [out, in]
and int4 packed [out, in/2] take the rule, scales [out] or [out, groups] its leading entries. A weight
whose dims do not divide over the mesh is replicated; a split is by shape only, so q/k/v rows may split
inside a head (SmolLM2's 9 heads over tensor=4): XLA then inserts the gathers, the results stay exact
and each device still holds 1/tensor of the weight. KV-cache heads that do not divide over `tensor`
(Gemma 3's single KV head) are replicated.

Multi-device work changes the rules below, never the model code. The same rules serve one host and
several (a mesh over the devices of every process, see multihost.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
AXES = (DATA, EXPERT, TENSOR)
REPLICATED = P()

# Weight name -> PartitionSpec of its [out, in] matrix. Unlisted weights (norms) are replicated.
PARAM_RULES: dict[str, P] = {
    "embed": P(TENSOR, None),  # vocab-parallel: [vocab, hidden]
    "lm_head": P(TENSOR, None),  # vocab-parallel logits
    "q_proj": P(TENSOR, None),  # column-parallel: heads
    "k_proj": P(TENSOR, None),
    "v_proj": P(TENSOR, None),
    "q_bias": P(TENSOR),  # with their projections' rows
    "k_bias": P(TENSOR),
    "v_bias": P(TENSOR),
    "gate_proj": P(TENSOR, None),  # column-parallel: MLP columns
    "up_proj": P(TENSOR, None),
    "o_proj": P(None, TENSOR),  # row-parallel: one all-reduce after attention
    "down_proj": P(None, TENSOR),  # row-parallel: one all-reduce after the MLP
    "expert_gate": P(EXPERT, TENSOR, None),  # [experts, inter, hidden]
    "expert_up": P(EXPERT, TENSOR, None),
    "expert_down": P(EXPERT, None, TENSOR),  # [experts, hidden, inter]
}


def make_mesh(shape: dict[str, int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, expert, tensor) mesh; `shape` like {"data": 2, "tensor": 4}; absent axes have size 1.
    Default: one device.

    Devices fill the grid row by row in `jax.devices()` order (process by process), tensor fastest, so a
    tensor group stays inside one host whenever `tensor` divides the devices per host.
    """
    shape = dict(shape or {})
    unknown = set(shape) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {', '.join(map(repr, AXES))}")
    dims = tuple(shape.get(axis, 1) for axis in AXES)
    if min(dims) < 1:
        raise ValueError(f"mesh sizes must be >= 1, got {shape=}")
    devices = list(devices if devices is not None else jax.devices())
    needed = int(np.prod(dims))
    if needed > len(devices):
        raise ValueError(f"mesh {shape} needs {needed} devices, only {len(devices)} available")
    grid = np.array(devices[:needed]).reshape(dims)
    # Auto axis types: XLA propagates shardings through matmuls (Explicit needs out_sharding= everywhere).
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


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
    return all(axis is None or dim % mesh.shape[axis] == 0 for axis, dim in zip(spec, shape))


def _rule(key_path: tuple[str | int, ...]) -> P:
    """The rule of the innermost named weight on the path: ("layers", 3, "q_proj", "scale") -> q_proj's."""
    for key in reversed(key_path):
        if isinstance(key, str) and key in PARAM_RULES:
            return PARAM_RULES[key]
    return REPLICATED


def param_spec(key_path: tuple[str | int, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec of one weight leaf; replicated when its dims do not divide over the mesh."""
    spec = P(*tuple(_rule(key_path))[: len(shape)])
    if all(axis is None for axis in spec):
        return REPLICATED
    return spec if _fits(spec, shape, mesh) else REPLICATED


def param_placement(mesh: Mesh):
    """A loader `Placement`: (key_path, shape, dtype) -> NamedSharding, so weights load into their shards."""

    def place(key_path: tuple[str | int, ...], shape: tuple[int, ...], dtype: str) -> NamedSharding:
        del dtype
        return NamedSharding(mesh, param_spec(key_path, shape, mesh))

    return place


def key_path_names(path) -> tuple[str | int, ...]:
    """A tree_util key path as names and indices (dict keys, list indices, dataclass field names)."""
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in path)


def param_shardings(params, mesh: Mesh):
    """The NamedSharding PARAM_RULES give every leaf of `params` (same tree structure)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: NamedSharding(mesh, param_spec(key_path_names(path), leaf.shape, mesh)), params
    )


def shard_params(params, mesh: Mesh):
    """Places a params pytree on the mesh following PARAM_RULES (a no-op for leaves already there)."""
    return jax.tree.map(jax.device_put, params, param_shardings(params, mesh))


def kv_cache_spec(num_kv_heads: int, mesh: Mesh) -> P:
    """The page pool [layers, kv_heads, pages, page_size, head_dim] is split over KV heads on `tensor`
    (replicated when the heads do not divide over it). Pages are not split over `data`: any row may
    hold any page, so each data replica keeps the whole pool."""
    head_axis = TENSOR if num_kv_heads % mesh.shape[TENSOR] == 0 else None
    return P(None, head_axis, None, None, None)


def slot_spec(num_slots: int, mesh: Mesh) -> P:
    """Per-slot state vectors follow the cache's slot split."""
    return P(DATA) if num_slots % mesh.shape[DATA] == 0 else REPLICATED
