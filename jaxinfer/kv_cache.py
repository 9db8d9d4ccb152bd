"""The paged KV cache: one preallocated pool of fixed-size pages per layer, shared by every request.

Layout: k, v are [layers, kv_heads, num_pages, page_size, head_dim] (axis letters L K P S D).
A request's positions live in the pages its page table names (host-side, scheduler.py): position p of
a request is at page `page_table[p // page_size]`, offset `p % page_size`. Why this layout:
  - one (layer, kv head, page) is a contiguous [page_size, head_dim] block, so a decode kernel that
    handles one (row, kv head) with all the query heads of its GQA group streams whole pages (the
    native CPU kernel and the Pallas kernels, pallas_kernels/paged_attention.py);
  - the kv-head axis sits right after the layer, where `tensor` splits it (sharding.kv_cache_spec),
    so a shard holds whole pages of its heads and reads stay local;
  - XLA's path gathers a row's pages with one `take` per layer ([K, rows, pages, S, D]) and attends
    over them without a transpose (kernel_dispatch.attention_xla takes keys in either order).
K and V are separate arrays rather than interleaved on the head axis (tpu-inference's form): the
kernels here read K and V in different loops, and separate arrays keep the int8 scales beside them.

Page 0 is the null page. It is never allocated: padding positions of a prefill chunk and decode rows
that hold no request write there (every scatter stays in bounds and in place), and page-table entries
past a request's pages point at it. Attention never reads it unmasked.

The pool is donated to every jitted step and written with scatters on the whole array, which XLA does
in place (per-layer slices as scan carries or `dynamic_update_slice` inside `vmap` made copies on
XLA:CPU). XLA:CPU has no bfloat16 scatter: it converts the whole cache to float32 and back around every
write. On CPU a bfloat16 cache therefore holds its uint16 bit patterns (`bf16_bits`), written with
integer scatters and read back through bitcasts, which cost nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import CacheConfig, ModelConfig
from jaxinfer.sharding import kv_cache_spec
from pallas_kernels import quantize_kv_int8

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """K and V pages of every layer; with an int8 cache, also one float32 scale per (head, token):
    k_scale, v_scale are [layers, kv_heads, num_pages, page_size]."""

    k: jax.Array  # [L, K, P, S, D]
    v: jax.Array  # [L, K, P, S, D]
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    bf16_bits: bool = dataclasses.field(metadata=dict(static=True), default=False)

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]

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

    def page_slots(self, page_table: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(page, offset) of each position, [b, t] each; positions < 0 map to the null page.

        page_table: [b, pages] int32; positions: [b, t] int32.
        """
        s = self.page_size
        valid = positions >= 0
        index = jnp.where(valid, positions // s, 0)
        pages = jnp.take_along_axis(page_table, index, axis=1)
        return jnp.where(valid, pages, NULL_PAGE), jnp.where(valid, positions % s, 0)

    def write(self, layer: int, pages: jax.Array, offsets: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Writes new entries of one layer at (page, offset) pairs from `page_slots`.

        pages, offsets: [b, t] int32; k, v: [b, t, kv_heads, head_dim].
        """

        def put(cache: jax.Array, values: jax.Array) -> jax.Array:
            # Advanced indices split by a slice put their broadcast dims first: [b, t, kv_heads, ...].
            return cache.at[layer, :, pages, offsets].set(self._to_storage(values, cache.dtype))

        if not self.quantized:
            return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))
        (k_q, k_s), (v_q, v_s) = quantize_kv_int8(k), quantize_kv_int8(v)
        return dataclasses.replace(
            self, k=put(self.k, k_q), v=put(self.v, v_q), k_scale=put(self.k_scale, k_s),
            v_scale=put(self.v_scale, v_s),
        )  # fmt: skip

    def read(self, layer: int, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The pages of one layer that `page_table` [b, n] names, in position order, dequantised:
        k, v as [kv_heads, b, n * page_size, head_dim] (kernel_dispatch.attention_xla's key order)."""
        b, n = page_table.shape

        def get(cache: jax.Array) -> jax.Array:
            x = jnp.take(cache[layer], page_table, axis=1)  # [K, b, n, S, ...]
            return x.reshape(x.shape[0], b, n * self.page_size, *x.shape[4:])

        if not self.quantized:
            return self._from_storage(get(self.k)), self._from_storage(get(self.v))
        k = get(self.k).astype(jnp.float32) * get(self.k_scale)[..., None]
        v = get(self.v).astype(jnp.float32) * get(self.v_scale)[..., None]
        return k, v


def contiguous_page_table(rows: int, pages_per_row: int) -> np.ndarray:
    """[rows, pages_per_row] int32: row r owns pages 1 + r * pages_per_row, ... in order (a pool of
    rows * pages_per_row + 1 pages): the simplest table, for evaluations that run the model directly."""
    return (1 + np.arange(rows * pages_per_row, dtype=np.int32)).reshape(rows, pages_per_row)


def cache_shape(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    return (model.num_layers, model.num_kv_heads, cache.num_pages, cache.page_size, model.head_dim)


def bytes_per_page(model: ModelConfig, page_size: int, dtype: str) -> int:
    """Device bytes of one page over every layer: K and V, plus their scales for an int8 cache."""
    per_value = jnp.dtype(dtype).itemsize
    values = model.num_layers * model.num_kv_heads * page_size * model.head_dim * 2 * per_value
    scales = model.num_layers * model.num_kv_heads * page_size * 2 * 4 if dtype == "int8" else 0
    return values + scales


def init_cache(model: ModelConfig, cache: CacheConfig, mesh: Mesh) -> KVCache:
    """A zeroed pool placed on the mesh (KV heads over `tensor`)."""
    spec = kv_cache_spec(model.num_kv_heads, mesh)
    shape = cache_shape(model, cache)

    def zeros(shape, dtype, spec):
        return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()

    if cache.dtype != "int8":
        bf16_bits = jnp.dtype(cache.dtype) == jnp.bfloat16 and mesh.devices.flat[0].platform == "cpu"
        dtype = jnp.uint16 if bf16_bits else cache.dtype
        return KVCache(k=zeros(shape, dtype, spec), v=zeros(shape, dtype, spec), bf16_bits=bf16_bits)
    # Scales drop the head_dim axis of the values.
    scale_shape, scale_spec = shape[:-1], P(*spec[:-1])
    return KVCache(
        k=zeros(shape, jnp.int8, spec),
        v=zeros(shape, jnp.int8, spec),
        k_scale=zeros(scale_shape, jnp.float32, scale_spec),
        v_scale=zeros(scale_shape, jnp.float32, scale_spec),
    )
