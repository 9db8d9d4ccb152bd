"""A model's layers held as one buffer per weight: every layer's leaf of one name, format and shape
stacked along a leading axis, for the native CPU kernels.

A compiled program's call costs host time for each argument buffer (jax's signature checks, PjRt's
holds on each buffer: ~1 us a buffer on XLA:CPU), and SmolLM2 in int4 passes 14 buffers a layer. Plain
decoding hides that behind the step before; a speculative step cannot, since its plan needs the last
step's result. Stacked, the layers pass one buffer per leaf name (or a few where a GGUF file mixes
formats across layers, as Q4_K_M does). The native matmul kernels read their layer of a stacked weight
in place (an offset, no copy: cpu_kernels/layer_slice.h); norms and biases are sliced inside the
program, where XLA fuses the slice into the op that reads them.

`LayerStack` stands where params["layers"] holds a list: it has the list's length, and indexing or
iterating it gives each layer's dict, with `LayerOf` in place of each kernel weight.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.weight_formats import Int8Weight, LayerOf, PackedInt4Weight, PackedInt5Weight

KERNEL_TYPES = (PackedInt4Weight, PackedInt5Weight, Int8Weight)  # what the native kernels read in place


@jax.tree_util.register_pytree_node_class
class LayerStack:
    """Layers as stacks: `stacks` are the stacked leaves, `where[i]` says for layer i where each of its
    named leaves lies, as (name, stack, row)."""

    def __init__(self, stacks: tuple, where: tuple[tuple[tuple[str, int, int], ...], ...]):
        self.stacks = stacks
        self.where = where

    def tree_flatten(self):
        return (self.stacks,), self.where

    @classmethod
    def tree_unflatten(cls, where, children):
        return cls(tuple(children[0]), where)

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {name: _row(self.stacks[s], row) for name, s, row in self.where[index]}

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _row(stack: Any, row: int) -> Any:
    return LayerOf(stack, row) if isinstance(stack, KERNEL_TYPES) else stack[row]


def _stackable(leaf: Any) -> bool:
    """Leaves whose layer the program can read without copying it: the native kernels' matrices (not
    stacked expert weights), and vectors (norms, biases) that only elementwise ops read."""
    if isinstance(leaf, Int8Weight):
        return leaf.vnni is not None and leaf.vnni.ndim == 4 and leaf.q is None and leaf.bf16 is None
    if isinstance(leaf, KERNEL_TYPES):
        return leaf.packed.ndim == 4
    return isinstance(leaf, jax.Array) and leaf.ndim == 1


def _signature(leaf: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(leaf)
    return type(leaf), treedef, tuple((a.shape, a.dtype) for a in leaves)


def stack_layers(layers: list[dict[str, Any]]) -> LayerStack | list[dict[str, Any]]:
    """The LayerStack of `layers` (one device), or `layers` as given where some leaf is not stackable
    (a float matrix, an Int8Weight an XLA product reads, mixture-of-experts weights): a product over a
    slice of a stacked matrix would copy the slice every step."""
    if not layers or not all(_stackable(leaf) for layer in layers for leaf in layer.values()):
        return layers
    groups: dict[tuple, list[Any]] = {}  # (name, signature) -> the leaves of one stack, in layer order
    where = []
    for layer in layers:
        placed = []
        for name, leaf in layer.items():
            key = (name, *_signature(leaf))
            members = groups.setdefault(key, [])
            placed.append((name, list(groups).index(key), len(members)))
            members.append(leaf)
        where.append(tuple(placed))
    stacks = tuple(jax.tree.map(lambda *a: jnp.stack(a), *members) for members in groups.values())
    return LayerStack(stacks, tuple(where))
