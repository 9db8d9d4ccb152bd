"""The preallocated KV cache: every layer, every slot, `max_len` positions, in one array each for K and V.

Layouts (CacheConfig.layout):
  "bhsd": k, v are [layers, slots, kv_heads, max_len, head_dim]
  "bshd": k, v are [layers, slots, max_len, kv_heads, head_dim]

The cache is donated to every jitted step and updated with scatters on the whole array, which XLA does in
place (per-layer slices as scan carries or `dynamic_update_slice` inside `vmap` made copies on XLA:CPU).
Writes at positions >= max_len are dropped: inactive slots write there so they never clobber a slot that is
being prefilled in chunks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxinfer.config import CacheConfig, ModelConfig
from jaxinfer.sharding import kv_cache_spec


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    layout: str = dataclasses.field(metadata=dict(static=True), default="bhsd")

    @property
    def max_len(self) -> int:
        return self.k.shape[3] if self.layout == "bhsd" else self.k.shape[2]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Writes new entries of one layer.

        slots: [batch] int32; positions: [batch, seq] int32; k, v: [batch, seq, kv_heads, head_dim].
        """
        slot_idx = slots[:, None]  # [batch, 1], broadcasts against positions
        if self.layout == "bhsd":
            # Advanced indices separated by a slice put their broadcast dims first: [batch, seq, kv_heads, dim].
            new_k = self.k.at[layer, slot_idx, :, positions].set(k.astype(self.k.dtype), mode="drop")
            new_v = self.v.at[layer, slot_idx, :, positions].set(v.astype(self.v.dtype), mode="drop")
        else:
            new_k = self.k.at[layer, slot_idx, positions].set(k.astype(self.k.dtype), mode="drop")
            new_v = self.v.at[layer, slot_idx, positions].set(v.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=new_k, v=new_v)

    def read(self, layer: int, slots: jax.Array | None, length: int) -> tuple[jax.Array, jax.Array]:
        """The first `length` positions of one layer as [batch, kv_heads, length, head_dim].

        slots=None reads every slot with a static slice (the decode case); otherwise gathers those slots.
        """
        k, v = self.k[layer], self.v[layer]
        if slots is not None:
            k, v = k[slots], v[slots]
        if self.layout == "bhsd":
            return k[:, :, :length], v[:, :, :length]
        return k[:, :length].swapaxes(1, 2), v[:, :length].swapaxes(1, 2)


def cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    if cache.layout == "bhsd":
        return (model.num_layers, cache.num_slots, model.num_kv_heads, cache.max_len, model.head_dim)
    return (model.num_layers, cache.num_slots, cache.max_len, model.num_kv_heads, model.head_dim)


def init_cache(model: ModelConfig, cache: CacheConfig, mesh: Mesh) -> KVCache:
    """A zeroed cache placed on the mesh (slots over `data`, KV heads over `tensor`)."""
    sharding = NamedSharding(mesh, kv_cache_spec(cache.layout, model.num_kv_heads, cache.num_slots, mesh))
    shape = cache_shape(model, cache)
    zeros = jax.jit(lambda: jnp.zeros(shape, cache.dtype), out_shardings=sharding)
    return KVCache(k=zeros(), v=zeros(), layout=cache.layout)


def cache_bytes(model: ModelConfig, cache: CacheConfig) -> int:
    n = 1
    for d in cache_shape(model, cache):
        n *= d
    return 2 * n * jnp.dtype(cache.dtype).itemsize
