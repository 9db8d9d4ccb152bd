"""The preallocated KV cache: every layer, every slot, `max_len` positions, in one array each for K and V.

Layouts (CacheConfig.layout):
  "bhsd": k, v are [layers, slots, kv_heads, max_len, head_dim]
  "bshd": k, v are [layers, slots, max_len, kv_heads, head_dim]

The cache is donated to every jitted step and updated with scatters on the whole array, which XLA does in
place (per-layer slices as scan carries or `dynamic_update_slice` inside `vmap` made copies on XLA:CPU).
Writes at positions >= max_len never reach a real position: inactive slots write there so they never
clobber a slot that is being prefilled in chunks. The position axis holds one spare column past max_len
that takes those writes and is never read, so every read, even of all max_len positions, is a strict
slice of the array: reading the whole axis of the buffer being updated in place made XLA copy the
entire cache once per layer (SmolLM2 at 1024 positions: 55 ms per decode step instead of 12).

XLA:CPU has no bfloat16 scatter: it converts the whole cache to float32 and back around every write
(SmolLM2 at 16 slots: ~1 s a step). On CPU a bfloat16 cache therefore holds its uint16 bit patterns
(`bf16_bits`), written with integer scatters and read back through bitcasts, which cost nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import CacheConfig, ModelConfig
from jaxinfer.sharding import kv_cache_spec
from pallas_kernels import quantize_kv_int8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """K and V of every layer and slot; with an int8 cache, also one float32 scale per (token, head):
    k_scale, v_scale are [layers, slots, kv_heads, max_len] ("bhsd") or [layers, slots, max_len, kv_heads]."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    layout: str = dataclasses.field(metadata=dict(static=True), default="bhsd")
    bf16_bits: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def max_len(self) -> int:
        """Usable positions (the array holds one more, see the module docstring)."""
        return (self.k.shape[3] if self.layout == "bhsd" else self.k.shape[2]) - 1

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        """k, v in their logical dtype (a bfloat16 view of the bit patterns where `bf16_bits`)."""
        return self._from_storage(self.k), self._from_storage(self.v)

    def _from_storage(self, x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if self.bf16_bits else x

    def _to_storage(self, x: jax.Array, dtype) -> jax.Array:
        if self.bf16_bits:
            return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
        return x.astype(dtype)

    def write(
        self, layer: int, slots: jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array
    ) -> KVCache:
        """Writes new entries of one layer.

        slots: [batch] int32; positions: [batch, seq] int32; k, v: [batch, seq, kv_heads, head_dim].
        """
        slot_idx = slots[:, None]  # [batch, 1], broadcasts against positions

        def put(cache: jax.Array, values: jax.Array) -> jax.Array:
            values = self._to_storage(values, cache.dtype)
            if self.layout == "bhsd":
                # Advanced indices split by a slice put their broadcast dims first: [batch, seq, heads, ...].
                return cache.at[layer, slot_idx, :, positions].set(values, mode="drop")
            return cache.at[layer, slot_idx, positions].set(values, mode="drop")

        if not self.quantized:
            return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))
        (k_q, k_s), (v_q, v_s) = quantize_kv_int8(k), quantize_kv_int8(v)
        return dataclasses.replace(
            self, k=put(self.k, k_q), v=put(self.v, v_q), k_scale=put(self.k_scale, k_s),
            v_scale=put(self.v_scale, v_s),
        )  # fmt: skip

    def read(self, layer: int, slots: jax.Array | int, length: int) -> tuple[jax.Array, jax.Array]:
        """The first `length` positions of one layer as [batch, kv_heads, length, head_dim] (dequantised).

        slots: an int n reads slots [0, n) with a static slice (the decode case); an array gathers those.
        """

        def get(cache: jax.Array) -> jax.Array:
            rows = cache[layer, :slots] if isinstance(slots, int) else cache[layer][slots]
            if self.layout == "bhsd":
                return rows[:, :, :length]
            return rows[:, :length].swapaxes(1, 2)

        if not self.quantized:
            return self._from_storage(get(self.k)), self._from_storage(get(self.v))
        k = get(self.k).astype(jnp.float32) * get(self.k_scale)[..., None]
        v = get(self.v).astype(jnp.float32) * get(self.v_scale)[..., None]
        return k, v


def cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    positions = cache.max_len + 1  # the spare column for dropped writes
    if cache.layout == "bhsd":
        return (model.num_layers, cache.num_slots, model.num_kv_heads, positions, model.head_dim)
    return (model.num_layers, cache.num_slots, positions, model.num_kv_heads, model.head_dim)


def init_cache(model: ModelConfig, cache: CacheConfig, mesh: Mesh) -> KVCache:
    """A zeroed cache placed on the mesh (slots over `data`, KV heads over `tensor`)."""
    spec = kv_cache_spec(cache.layout, model.num_kv_heads, cache.num_slots, mesh)
    shape = cache_shape(model, cache)

    def zeros(shape, dtype, spec):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()

    if cache.dtype != "int8":
        bf16_bits = jnp.dtype(cache.dtype) == jnp.bfloat16 and mesh.devices.flat[0].platform == "cpu"
        dtype = jnp.uint16 if bf16_bits else cache.dtype
        k, v = zeros(shape, dtype, spec), zeros(shape, dtype, spec)
        return KVCache(k=k, v=v, layout=cache.layout, bf16_bits=bf16_bits)
    # Scales drop the head_dim axis of the values.
    scale_shape, scale_spec = shape[:-1], P(*spec[:-1])
    return KVCache(
        k=zeros(shape, jnp.int8, spec),
        v=zeros(shape, jnp.int8, spec),
        k_scale=zeros(scale_shape, jnp.float32, scale_spec),
        v_scale=zeros(scale_shape, jnp.float32, scale_spec),
        layout=cache.layout,
    )
