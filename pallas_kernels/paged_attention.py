"""Attention over a paged KV cache: decode (one new query per row) and chunked prefill.

Axis letters: L layers, B rows (sequences), N query heads, K kv heads, G = N // K query heads per kv head,
P pages in the pool, S page size (keys per page), R page-table entries per row (pages_per_row),
T query positions of a prefill chunk, D head dim.

Layout. K and V live in a pool of fixed-size pages, `k_pages` / `v_pages` [L, K, P, S, D], shared by all
rows. Row b owns the pages listed in `page_table[b]` [R]: its logical key position p is at page
`page_table[b, p // S]`, offset `p % S`. Pages are allocated and freed one at a time, so rows of any length
share one pool without reserving `max_len` keys each; the kernels do not care whether a row's pages are
contiguous. Page-table entries past a row's length may hold anything in [0, P) (page 0 is typically a
reserved null page full of garbage). int8 pages carry one float32 scale per key and head,
`k_scale` / `v_scale` [L, K, P, S] (value = int8 * scale).

Reading. The pallas_calls take the whole pool and the static `layer` is picked by the BlockSpec index map
(no slice or copy of a layer, nor a gather of pages, happens outside the kernel). One program handles one
(row, kv head [, split] [, query block]) and all G query heads of that kv head together, so a page is
loaded once per kv head (GQA / MQA without repeating K/V). It loops over the logical pages of its row that
hold a key some of its queries can see (ragged lengths, causal frontier, sliding window), looks each one up
in the page table (a scalar table) and loads only that page: pages past a row's length or before its window
are never touched on GPU and in interpret mode. The loop steps `pages_per_block` pages at a time with one
online-softmax update per step; the pages of the last step that lie past the row's range re-read the
range's last page (already cached) and are fully masked, so the kernel never follows a page-table entry it
does not need. Key slots past a row's length inside a visited page (stale data, possibly NaN) are masked
in the scores and zeroed in V, so garbage there cannot leak into the output.

int8 pages are read as int8 and dequantised in the kernel without building a dequantised tile: the key
scale multiplies the scores column-wise (q.(k * s) == (q.k) * s) and the value scale is folded into the
probabilities (p @ (v * s) == (p * s) @ v). Float pages are cast to the compute dtype, the promotion of q's
and the cache's dtypes (a float32 q over a bfloat16 cache computes in float32). Softmax statistics and
the output accumulator are always float32.

Decode splits each row's pages over `num_splits` programs (split-K / flash-decoding) and merges their
partial outputs by log-sum-exp, like `decode_attention`.

Backends: the page size is a power of two, at least the backend's smallest matmul operand (8 on TPU and in
interpret mode, 16 for Triton's tl.dot on GPU). On GPU (Triton) and in interpret mode the K/V BlockSpec
covers one (layer, kv head)'s pool, which Triton sees as a pointer: only visited pages are loaded. Mosaic
would copy such a block to VMEM whole, which a real pool does not fit, so on TPU the pool stays in HBM
(`memory_space=ANY`) and each step's pages are copied into a double buffer in VMEM by async DMA, the next
step's copies running while the current step computes (`_PageCopies`). `interpret=pltpu.InterpretParams()`
runs that TPU form on CPU (TPU interpret mode simulates the DMAs and semaphores); tests do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import (
    MASK_VALUE,
    cdiv_nonneg,
    check_block,
    compiler_params,
    default_interpret,
    div_nonneg,
    dot_nn,
    dot_nt,
    is_power_of_two,
    min_dot_rows,
    pad_axis,
    scalar_table_spec,
    tpu_form,
)

# The split-K merge is the same as the contiguous decode kernel's.
from pallas_kernels.decode_attention import _combine_splits

__all__ = [
    "DecodeBlockSizes",
    "PrefillBlockSizes",
    "default_interpret",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]

SUPPORTED_HEAD_DIMS = (64, 128, 256)
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)


def _default_pages_per_block(head_dim: int, page_size: int, num_pages: int) -> int:
    """About 128 keys per step (64 for 256-wide heads), never more pages than the row range holds."""
    keys = 64 if head_dim > 128 else 128
    return max(1, min(keys // page_size, pl.next_power_of_2(max(num_pages, 1))))


@dataclasses.dataclass(frozen=True)
class DecodeBlockSizes:
    """Pages per online-softmax step (a power of two). Frozen so it can be a static jit argument."""

    pages_per_block: int = 8

    def __post_init__(self):
        check_block("pages_per_block", self.pages_per_block)

    @classmethod
    def get_default(cls, head_dim: int, page_size: int, pages_per_split: int) -> DecodeBlockSizes:
        return cls(pages_per_block=_default_pages_per_block(head_dim, page_size, pages_per_split))


@dataclasses.dataclass(frozen=True)
class PrefillBlockSizes:
    """Query positions per program and pages per online-softmax step (powers of two).

    A program's matmul has G_pad * block_q rows (G_pad: G rounded up to a power of two).
    """

    block_q: int = 32
    pages_per_block: int = 8

    def __post_init__(self):
        check_block("block_q", self.block_q)
        check_block("pages_per_block", self.pages_per_block)

    @classmethod
    def get_default(
        cls, head_dim: int, page_size: int, pages_per_row: int, q_len: int, group: int
    ) -> PrefillBlockSizes:
        group_padded = pl.next_power_of_2(group)
        rows = 64 if head_dim > 128 else 128
        block_q = min(max(1, rows // group_padded), pl.next_power_of_2(q_len))
        # The backend's smallest matmul operand (a power of two, as is group_padded).
        block_q = max(block_q, pl.cdiv(min_dot_rows(), group_padded))
        return cls(
            block_q=block_q,
            pages_per_block=_default_pages_per_block(head_dim, page_size, pages_per_row),
        )


def _check_cache(q, k_pages, v_pages, page_table, layer, sliding_window, logit_softcap, k_scale, v_scale):
    """Checks shared by both kernels; q is [B, ..., N, D]."""
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"pages must be equal [layers, kv_heads, num_pages, page_size, dim]: {k_pages.shape=} "
            f"{v_pages.shape=}"
        )
    num_rows, num_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    num_layers, num_kv_heads, num_pages, page_size, page_dim = k_pages.shape
    if page_dim != head_dim:
        raise ValueError(f"q and pages disagree on head_dim: {q.shape=} {k_pages.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads=} must be a multiple of {num_kv_heads=}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{head_dim=} must be one of {SUPPORTED_HEAD_DIMS}")
    if not is_power_of_two(page_size) or page_size < min_dot_rows():
        raise ValueError(f"{page_size=} must be a power of two >= {min_dot_rows()} on this backend")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{q.dtype=} must be float32 or bfloat16")
    if k_pages.dtype != v_pages.dtype or k_pages.dtype not in (*FLOAT_DTYPES, jnp.int8):
        raise ValueError(
            f"pages must share a dtype in float32/bfloat16/int8: {k_pages.dtype=} {v_pages.dtype=}"
        )
    if k_pages.dtype == jnp.int8:
        scale_shape = k_pages.shape[:4]
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None or scale.shape != scale_shape or scale.dtype != jnp.float32:
                shape = None if scale is None else (scale.shape, scale.dtype)
                raise ValueError(f"int8 pages need {name} float32 {scale_shape}; got {name}={shape}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale are only for int8 pages; got {k_pages.dtype=}")
    if (
        page_table.ndim != 2
        or page_table.shape[0] != num_rows
        or page_table.shape[1] < 1
        or not jnp.issubdtype(page_table.dtype, jnp.integer)
    ):
        raise ValueError(
            f"page_table must be int [{num_rows}, pages_per_row]; got {page_table.shape=} {page_table.dtype=}"
        )
    if not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(f"{layer=} must be a static int in [0, {num_layers=})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be a positive int or None")
    if logit_softcap is not None and logit_softcap <= 0:
        raise ValueError(f"{logit_softcap=} must be positive or None")


def _check_table(name: str, table, num_rows: int) -> None:
    if table.shape != (num_rows,) or not jnp.issubdtype(table.dtype, jnp.integer):
        raise ValueError(f"{name} must be int of shape ({num_rows},); got {table.shape=} {table.dtype=}")


def _check_decode(q, lengths, num_splits) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [rows, num_heads, head_dim]; got {q.shape=}")
    _check_table("lengths", lengths, q.shape[0])
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"{num_splits=} must be a positive int")


def _compute_dtype(q: jax.Array, k_pages: jax.Array):
    """Matmul operand dtype: q's for int8 pages, else the promotion of q's and the pages' dtypes."""
    if k_pages.dtype == jnp.int8:
        return q.dtype
    return jnp.promote_types(q.dtype, k_pages.dtype)


def _num_pools(quantized: bool) -> int:
    """Pool operands of the kernels: K and V pages, and for int8 pages their two scale arrays."""
    return 4 if quantized else 2


def _kv_specs(k_pages, layer: int, quantized: bool, kv_head_of, tpu: bool) -> list[pl.BlockSpec]:
    """BlockSpecs of one (layer, kv head)'s whole page pool (and its scales); the layer is chosen here.

    `kv_head_of(*grid_indices)` gives the kv head of a program. In the TPU form the pool stays in HBM and
    the kernel copies pages itself.
    """
    count = _num_pools(quantized)
    if tpu:
        return [pl.BlockSpec(memory_space=pl.ANY)] * count
    _, _, num_pages, page_size, head_dim = k_pages.shape

    def index_map(*idx):
        return layer, kv_head_of(*idx), 0, 0, 0

    page_spec = pl.BlockSpec((None, None, num_pages, page_size, head_dim), index_map)
    # Scales are passed as [L, K, P, 1, S] (a free reshape) so a page's scales load as a [1, S] row.
    scale_spec = pl.BlockSpec((None, None, num_pages, 1, page_size), index_map)
    return [page_spec, page_spec, scale_spec, scale_spec][:count]


def _page_buffers(k_pages, pages_per_block: int, quantized: bool, tpu: bool) -> list:
    """VMEM scratch of the TPU form: K and V (and scale) double buffers of one step's pages, one DMA
    semaphore per buffer. Empty elsewhere."""
    if not tpu:
        return []
    _, _, _, page_size, head_dim = k_pages.shape
    pages = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    scales = [pltpu.VMEM((2, pages_per_block, 1, page_size), jnp.float32)] * 2 if quantized else []
    return [pages, pages, *scales, pltpu.SemaphoreType.DMA((2,))]


class _PageCopies:
    """Double-buffered DMA of each step's pages from the HBM pool into VMEM (the TPU form).

    Step `step` of the page loop reads buffer `step % 2`; `start(step + 1)` fills the other buffer while
    `step` computes. Every copy of a buffer signals that buffer's semaphore and is waited for one by one.
    """

    copies = True

    def __init__(self, pools, buffers, sems, *, layer, kv_head, page_of, pages_per_block):
        self.pools, self.buffers, self.sems = pools, buffers, sems  # [L, K, P, ...] / [2, ppb, ...]
        self.layer, self.kv_head, self.page_of = layer, kv_head, page_of
        self.pages_per_block = pages_per_block

    def _copies(self, step):
        slot = lax.rem(step, 2)
        for i in range(self.pages_per_block):
            page = self.page_of(step, i)
            for pool, buffer in zip(self.pools, self.buffers):
                src = pool.at[self.layer, self.kv_head, page]
                yield pltpu.make_async_copy(src, buffer.at[slot, i], self.sems.at[slot])

    def start(self, step) -> None:
        for copy in self._copies(step):
            copy.start()

    def wait(self, step) -> None:
        for copy in self._copies(step):
            copy.wait()

    def page(self, step, i):
        """(k [S, D], v [S, D], k_scale [1, S] | None, v_scale [1, S] | None) of page i of a step."""
        slot = lax.rem(step, 2)
        return _with_scales([buffer[slot, i] for buffer in self.buffers])


class _PoolBlocks:
    """The pool as a kernel block (GPU, interpret mode): a page is read where it lies, nothing to copy."""

    copies = False

    def __init__(self, pools, page_of):
        self.pools, self.page_of = pools, page_of  # [P, S, D] / [P, 1, S] refs of one (layer, kv head)

    def page(self, step, i):
        page = self.page_of(step, i)
        return _with_scales([pool[page] for pool in self.pools])


def _with_scales(parts: list) -> tuple:
    """(k, v, k_scale, v_scale) from a page's two (float) or four (int8) parts; no scales: None."""
    return (*parts, None, None) if len(parts) == 2 else tuple(parts)


def _kv_operands(k_pages, v_pages, k_scale, v_scale) -> list[jax.Array]:
    if k_pages.dtype != jnp.int8:
        return [k_pages, v_pages]
    scale_shape = (*k_scale.shape[:3], 1, k_scale.shape[3])  # [L, K, P, 1, S]
    return [k_pages, v_pages, k_scale.reshape(scale_shape), v_scale.reshape(scale_shape)]


def _attend_pages(
    q,  # [M, D] compute dtype
    q_pos,  # scalar or [M, 1] int32: absolute position of each query row
    page_table_ref,  # [B * R] int32 (whole table, flattened)
    pool_refs,  # k, v [P, S, D] (and k_scale, v_scale [P, 1, S] f32): the pool's block; TPU form: the
    # HBM pools [L, K, P, ...]
    scratch,  # TPU form: the buffers and semaphores of _page_buffers; else empty
    *,
    layer: int,
    page_size: int,
    table_base,  # b * R: this row's first page-table entry
    lo,  # first logical page to visit
    hi,  # one past the last logical page to visit (<= R)
    key_end,  # keys at logical positions >= key_end are invisible (<= hi * S)
    sm_scale: float,
    causal: bool,
    sliding_window: int | None,
    logit_softcap: float | None,
    pages_per_block: int,
):
    """Online softmax of the rows of q over logical pages [lo, hi) of one row.

    Returns the float32 (row max [M, 1], denominator [M, 1], unnormalised output [M, D]).
    """
    num_rows, head_dim = q.shape
    last_page = hi - 1

    def page_of(step, i):
        # Pages past the range re-read its last page (cached on GPU, copied again on TPU); their keys are
        # masked below.
        return page_table_ref[table_base + jnp.minimum(lo + step * pages_per_block + i, last_page)]

    if scratch:
        *buffers, sems = scratch
        source = _PageCopies(
            pool_refs, buffers, sems, layer=layer, kv_head=pl.program_id(1), page_of=page_of,
            pages_per_block=pages_per_block,
        )  # fmt: skip
    else:
        source = _PoolBlocks(pool_refs, page_of)
    num_steps = cdiv_nonneg(hi - lo, pages_per_block)

    def body(step, carry):
        row_max, denom, acc = carry  # [M, 1], [M, 1], [M, D]
        if source.copies:

            @pl.when(step + 1 < num_steps)
            def _():
                source.start(step + 1)

            source.wait(step)
        first = lo + step * pages_per_block
        scores, values = [], []
        for i in range(pages_per_block):
            logical = first + i
            k, v, k_scale, v_scale = source.page(step, i)  # [S, D], [S, D], [1, S] | None, [1, S] | None
            k_pos = logical * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # [1, S]
            key_valid = k_pos < key_end  # [1, S]
            s = dot_nt(q, k.astype(q.dtype))  # [M, S]
            if k_scale is not None:
                s = s * k_scale  # per-key scales
            s = s * sm_scale
            if logit_softcap is not None:
                s = logit_softcap * jnp.tanh(s / logit_softcap)
            visible = key_valid
            if causal:
                visible = visible & (k_pos <= q_pos)
            if sliding_window is not None:
                visible = visible & (k_pos > q_pos - sliding_window)
            scores.append((jnp.where(visible, s, MASK_VALUE), visible))
            if v_scale is not None:
                # Zero the scales of invalid slots (they may hold anything); int8 values are finite.
                values.append((v.astype(q.dtype), jnp.where(key_valid, v_scale, 0.0)))
            else:
                valid_rows = logical * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
                values.append((jnp.where(valid_rows < key_end, v.astype(q.dtype), 0), None))
        max_new = row_max
        for s, _ in scores:
            max_new = jnp.maximum(max_new, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(row_max - max_new)
        denom = alpha * denom
        acc = alpha * acc
        for (s, visible), (v, v_scale) in zip(scores, values):
            # Explicit zero for hidden keys: a row with nothing visible yet has s == max_new == MASK_VALUE.
            p = jnp.where(visible, jnp.exp(s - max_new), 0.0)  # [M, S]
            denom = denom + jnp.sum(p, axis=1, keepdims=True)
            if v_scale is not None:
                p = p * v_scale
            acc = acc + dot_nn(p.astype(v.dtype), v)
        return max_new, denom, acc

    init = (
        jnp.full((num_rows, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((num_rows, 1), jnp.float32),
        jnp.zeros((num_rows, head_dim), jnp.float32),
    )
    if source.copies:

        @pl.when(num_steps > 0)
        def _():
            source.start(0)

    return lax.fori_loop(0, num_steps, body, init)


# ----------------------------------------------------------------------------------------------------------
# Decode


@functools.partial(
    jax.jit,
    static_argnames=[
        "layer",
        "sm_scale",
        "sliding_window",
        "logit_softcap",
        "block_sizes",
        "num_splits",
        "interpret",
    ],
)
def paged_decode_attention(
    q: jax.Array,  # [B, N, D]
    k_pages: jax.Array,  # [L, K, P, S, D]
    v_pages: jax.Array,  # [L, K, P, S, D]
    lengths: jax.Array,  # [B] int32, valid keys per row incl. the new one (0 = inactive row)
    page_table: jax.Array,  # [B, R] int32
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | None = None,  # [L, K, P, S] f32, int8 pages only
    v_scale: jax.Array | None = None,  # [L, K, P, S] f32, int8 pages only
    block_sizes: DecodeBlockSizes | None = None,
    num_splits: int = 1,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> jax.Array:  # [B, N, D], dtype of q
    """Attention of each row's newest token (at position lengths[b] - 1) over its paged keys.

    Key j of row b is visible iff j < lengths[b] and (sliding_window is None or
    j > lengths[b] - 1 - sliding_window). Logits are `sm_scale * q.k`, soft-capped as `cap * tanh(s / cap)`
    before masking. Inactive rows (lengths 0) return zeros. lengths are clamped to R * S. `num_splits`
    programs share each row's pages. Every keyword argument except the scales is static.
    """
    _check_cache(q, k_pages, v_pages, page_table, layer, sliding_window, logit_softcap, k_scale, v_scale)
    _check_decode(q, lengths, num_splits)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    pages_per_row = page_table.shape[1]
    pages_per_split = pl.cdiv(pages_per_row, num_splits)
    if block_sizes is None:
        block_sizes = DecodeBlockSizes.get_default(head_dim, page_size, pages_per_split)
    interpret = default_interpret() if interpret is None else interpret
    tpu = tpu_form(interpret)
    quantized = k_pages.dtype == jnp.int8
    group = num_heads // num_kv_heads

    # [B, N, D] -> [B, K, G_pad, D]: query heads of one kv head are adjacent (n = kv_head * G + g).
    # The G rows are the M side of the q.k matmul, padded to what the backend's matmul needs.
    group_padded = max(min_dot_rows(), pl.next_power_of_2(group))
    q_grouped = q.astype(_compute_dtype(q, k_pages)).reshape(num_rows, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))

    kernel = functools.partial(
        _paged_decode_kernel,
        quantized=quantized,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        pages_per_block=block_sizes.pages_per_block,
        pages_per_split=pages_per_split,
        pages_per_row=pages_per_row,
        layer=layer,
        page_size=page_size,
    )

    def q_index_map(b, h, s):
        del s
        return b, h, 0, 0

    def partial_index_map(b, h, s):
        return b, h, s, 0, 0

    partial_shape = (num_rows, num_kv_heads, num_splits, group_padded)
    partial_out, partial_lse = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_splits),
        in_specs=[
            scalar_table_spec((num_rows,), smem=tpu),  # lengths
            scalar_table_spec((num_rows * pages_per_row,), smem=tpu),  # page table, flattened
            pl.BlockSpec((None, None, group_padded, head_dim), q_index_map),
            *_kv_specs(k_pages, layer, quantized, lambda b, h, s: h, tpu),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, group_padded, head_dim), partial_index_map),
            pl.BlockSpec((None, None, None, group_padded, 1), partial_index_map),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((*partial_shape, 1), jnp.float32),
        ],
        scratch_shapes=_page_buffers(k_pages, block_sizes.pages_per_block, quantized, tpu),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_decode_attention",
    )(
        lengths.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        q_grouped,
        *_kv_operands(k_pages, v_pages, k_scale, v_scale),
    )

    out = _combine_splits(partial_out, partial_lse)  # [B, K, G_pad, D]
    return out[:, :, :group].reshape(num_rows, num_heads, head_dim).astype(q.dtype)


def _paged_decode_kernel(
    # inputs: lengths_ref [B], page_table_ref [B * R], q_ref [G_pad, D], k_ref / v_ref [P, S, D],
    # then (int8 pages only) k_scale_ref / v_scale_ref [P, 1, S] (TPU form: the whole pools in HBM);
    # outputs: out_ref [G_pad, D] f32 (this split's normalised partial), lse_ref [G_pad, 1] f32;
    # TPU form: then the scratch of _page_buffers
    *refs,
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    pages_per_block: int,
    pages_per_split: int,
    pages_per_row: int,
    layer: int,
    page_size: int,
):
    num_pools = _num_pools(quantized)
    lengths_ref, page_table_ref, q_ref = refs[:3]
    pool_refs = refs[3 : 3 + num_pools]
    out_ref, lse_ref = refs[3 + num_pools : 5 + num_pools]
    scratch = refs[5 + num_pools :]
    b, split = pl.program_id(0), pl.program_id(2)
    length = jnp.minimum(lengths_ref[b], pages_per_row * page_size)
    query_pos = length - 1

    # This split owns logical pages [split * pps, (split + 1) * pps); visit those holding visible keys.
    lo = split * pages_per_split
    hi = jnp.minimum(jnp.minimum(lo + pages_per_split, pages_per_row), cdiv_nonneg(length, page_size))
    if sliding_window is not None:
        lo = jnp.maximum(lo, div_nonneg(query_pos - sliding_window + 1, page_size))

    row_max, denom, acc = _attend_pages(
        q_ref[...],
        query_pos,
        page_table_ref,
        pool_refs,
        scratch,
        layer=layer,
        page_size=page_size,
        table_base=b * pages_per_row,
        lo=lo,
        hi=hi,
        key_end=jnp.minimum(length, hi * page_size),  # keys of later splits are theirs
        sm_scale=sm_scale,
        causal=False,  # every key < length is at or before the query
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        pages_per_block=pages_per_block,
    )
    seen = denom > 0.0
    safe_denom = jnp.where(seen, denom, 1.0)
    out_ref[...] = acc / safe_denom
    lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_denom), MASK_VALUE)


def _gather_pages(pages, scale, page_table, layer: int, dtype) -> jax.Array:
    """[L, K, P, S, D] pages of `layer` gathered by row: [B, K, R * S, D] in `dtype` (dequantised)."""
    num_rows, pages_per_row = page_table.shape
    _, num_kv_heads, _, page_size, head_dim = pages.shape
    x = pages[layer][:, page_table].astype(jnp.float32)  # [K, B, R, S, D]
    if scale is not None:
        x = x * scale[layer][:, page_table][..., None]
    x = jnp.swapaxes(x, 0, 1).reshape(num_rows, num_kv_heads, pages_per_row * page_size, head_dim)
    return x.astype(dtype)


def _masked_softmax(s, visible):
    """f32 softmax of s over the last axis, restricted to `visible` (rows with nothing visible give 0)."""
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(denom == 0.0, 1.0, denom)


def paged_decode_attention_reference(
    q: jax.Array,  # [B, N, D]
    k_pages: jax.Array,  # [L, K, P, S, D]
    v_pages: jax.Array,  # [L, K, P, S, D]
    lengths: jax.Array,  # [B]
    page_table: jax.Array,  # [B, R]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    block_sizes: DecodeBlockSizes | None = None,
    num_splits: int = 1,
    interpret: bool | None = None,
) -> jax.Array:  # [B, N, D]
    """Plain-jnp paged decode attention: gathers each row's pages, f32 masked softmax."""
    del block_sizes, interpret
    _check_cache(q, k_pages, v_pages, page_table, layer, sliding_window, logit_softcap, k_scale, v_scale)
    _check_decode(q, lengths, num_splits)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    dtype = _compute_dtype(q, k_pages)
    k = _gather_pages(k_pages, k_scale, page_table, layer, dtype)  # [B, K, R * S, D]
    v = _gather_pages(v_pages, v_scale, page_table, layer, jnp.float32)
    num_keys = k.shape[2]
    length = jnp.minimum(lengths, num_keys)[:, None]  # [B, 1]
    k_pos = jnp.arange(num_keys)[None, :]  # [1, R * S]
    key_valid = k_pos < length  # [B, R * S]
    visible = key_valid
    if sliding_window is not None:
        visible = visible & (k_pos > length - 1 - sliding_window)
    qg = q.astype(dtype).reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("bkgd,bkmd->bkgm", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    v = jnp.where(key_valid[:, None, :, None], v, 0.0)  # slots past the length may hold anything
    p = _masked_softmax(s, visible[:, None, None, :])
    out = jnp.einsum("bkgm,bkmd->bkgd", p, v)  # [B, K, G, D]
    return out.reshape(num_rows, num_heads, head_dim).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Prefill


@functools.partial(
    jax.jit,
    static_argnames=["layer", "sm_scale", "sliding_window", "logit_softcap", "block_sizes", "interpret"],
)
def paged_prefill_attention(
    q: jax.Array,  # [B, T, N, D]
    k_pages: jax.Array,  # [L, K, P, S, D], the chunk's own keys already written
    v_pages: jax.Array,  # [L, K, P, S, D]
    q_start: jax.Array,  # [B] int32, absolute position of q[b, 0]
    kv_lens: jax.Array,  # [B] int32, keys valid in the pages per row
    page_table: jax.Array,  # [B, R] int32
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | None = None,  # [L, K, P, S] f32, int8 pages only
    v_scale: jax.Array | None = None,  # [L, K, P, S] f32, int8 pages only
    block_sizes: PrefillBlockSizes | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
) -> jax.Array:  # [B, T, N, D], dtype of q
    """Causal attention of a chunk of queries over the paged keys of its row (cached prefix + the chunk).

    Query t of row b sits at position p = q_start[b] + t and sees key j iff j < kv_lens[b], j <= p and
    (sliding_window is None or j > p - sliding_window). Queries that see no key return zeros; padding
    queries (p >= kv_lens[b]) return finite values. kv_lens are clamped to R * S. Every keyword argument
    except the scales is static.
    """
    _check_cache(q, k_pages, v_pages, page_table, layer, sliding_window, logit_softcap, k_scale, v_scale)
    if q.ndim != 4:
        raise ValueError(f"q must be [rows, q_len, num_heads, head_dim]; got {q.shape=}")
    num_rows, q_len, num_heads, head_dim = q.shape
    _check_table("q_start", q_start, num_rows)
    _check_table("kv_lens", kv_lens, num_rows)
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[3]
    pages_per_row = page_table.shape[1]
    group = num_heads // num_kv_heads
    if block_sizes is None:
        block_sizes = PrefillBlockSizes.get_default(head_dim, page_size, pages_per_row, q_len, group)
    interpret = default_interpret() if interpret is None else interpret
    tpu = tpu_form(interpret)
    quantized = k_pages.dtype == jnp.int8
    block_q = block_sizes.block_q
    group_padded = pl.next_power_of_2(group)
    block_rows = group_padded * block_q
    if block_rows < min_dot_rows():
        raise ValueError(f"{block_q=} * {group_padded=} must be >= {min_dot_rows()} on this backend")

    # [B, T, N, D] -> [B, K, Q, G_pad * block_q, D] (Q query blocks): one program's rows are contiguous,
    # ordered (g, t) so that a row's query offset is `row % block_q`.
    q_c = pad_axis(q.astype(_compute_dtype(q, k_pages)), 1, block_q)
    num_q_blocks = q_c.shape[1] // block_q
    q_c = q_c.reshape(num_rows, num_q_blocks, block_q, num_kv_heads, group, head_dim)
    q_c = jnp.pad(q_c, ((0, 0),) * 4 + ((0, group_padded - group), (0, 0)))
    q_c = q_c.transpose(0, 3, 1, 4, 2, 5).reshape(num_rows, num_kv_heads, num_q_blocks, block_rows, head_dim)

    kernel = functools.partial(
        _paged_prefill_kernel,
        quantized=quantized,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        block_q=block_q,
        pages_per_block=block_sizes.pages_per_block,
        pages_per_row=pages_per_row,
        layer=layer,
        page_size=page_size,
    )

    def q_index_map(b, h, qi):
        return b, h, qi, 0, 0

    q_spec = pl.BlockSpec((None, None, None, block_rows, head_dim), q_index_map)
    itemsize = k_pages.dtype.itemsize
    out = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_q_blocks),
        in_specs=[
            scalar_table_spec((num_rows,), smem=tpu),  # q_start
            scalar_table_spec((num_rows,), smem=tpu),  # kv_lens
            scalar_table_spec((num_rows * pages_per_row,), smem=tpu),  # page table, flattened
            q_spec,
            *_kv_specs(k_pages, layer, quantized, lambda b, h, qi: h, tpu),
        ],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_c.shape, q.dtype),
        scratch_shapes=_page_buffers(k_pages, block_sizes.pages_per_block, quantized, tpu),
        compiler_params=compiler_params(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
        cost_estimate=pl.CostEstimate(
            flops=4 * num_rows * num_heads * q_len * pages_per_row * page_size * head_dim,
            transcendentals=num_rows * num_heads * q_len * pages_per_row * page_size,
            bytes_accessed=2 * q.size * q.dtype.itemsize
            + 2 * num_rows * num_kv_heads * pages_per_row * page_size * head_dim * itemsize,
        ),
        interpret=interpret,
        name="paged_prefill_attention",
    )(
        q_start.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        page_table.astype(jnp.int32).reshape(-1),
        q_c,
        *_kv_operands(k_pages, v_pages, k_scale, v_scale),
    )
    out = out.reshape(num_rows, num_kv_heads, num_q_blocks, group_padded, block_q, head_dim)
    out = out.transpose(0, 2, 4, 1, 3, 5)[:, :, :, :, :group]  # [B, Q, block_q, K, G, D]
    return out.reshape(num_rows, num_q_blocks * block_q, num_heads, head_dim)[:, :q_len]


def _paged_prefill_kernel(
    # inputs: q_start_ref [B], kv_lens_ref [B], page_table_ref [B * R], q_ref [G_pad * block_q, D],
    # k_ref / v_ref [P, S, D], then (int8 pages only) k_scale_ref / v_scale_ref [P, 1, S] (TPU form: the
    # whole pools in HBM); output: o_ref [G_pad * block_q, D]; TPU form: then the scratch of _page_buffers
    *refs,
    quantized: bool,
    sm_scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    block_q: int,
    pages_per_block: int,
    pages_per_row: int,
    layer: int,
    page_size: int,
):
    num_pools = _num_pools(quantized)
    q_start_ref, kv_lens_ref, page_table_ref, q_ref = refs[:4]
    pool_refs = refs[4 : 4 + num_pools]
    o_ref = refs[4 + num_pools]
    scratch = refs[5 + num_pools :]
    b, qi = pl.program_id(0), pl.program_id(2)
    kv_len = jnp.minimum(kv_lens_ref[b], pages_per_row * page_size)
    first_pos = q_start_ref[b] + qi * block_q  # absolute position of this block's first query
    last_pos = first_pos + block_q - 1

    # Logical pages [lo, hi) hold every key some query of this block may see; no other page is loaded.
    hi = cdiv_nonneg(jnp.minimum(kv_len, last_pos + 1), page_size)
    lo = jnp.int32(0)
    if sliding_window is not None:
        lo = div_nonneg(first_pos - sliding_window + 1, page_size)

    q = q_ref[...]  # [G_pad * block_q, D]
    row = lax.broadcasted_iota(jnp.int32, (q.shape[0], 1), 0)
    q_pos = first_pos + jnp.bitwise_and(row, block_q - 1)  # [G_pad * block_q, 1], rows ordered (g, t)
    _, denom, acc = _attend_pages(
        q,
        q_pos,
        page_table_ref,
        pool_refs,
        scratch,
        layer=layer,
        page_size=page_size,
        table_base=b * pages_per_row,
        lo=lo,
        hi=hi,
        key_end=jnp.minimum(kv_len, hi * page_size),
        sm_scale=sm_scale,
        causal=True,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
        pages_per_block=pages_per_block,
    )
    # Rows that saw no key have denom == 0 and acc == 0: emit zeros, not 0/0.
    o_ref[...] = (acc / jnp.where(denom == 0.0, 1.0, denom)).astype(o_ref.dtype)


def paged_prefill_attention_reference(
    q: jax.Array,  # [B, T, N, D]
    k_pages: jax.Array,  # [L, K, P, S, D]
    v_pages: jax.Array,  # [L, K, P, S, D]
    q_start: jax.Array,  # [B]
    kv_lens: jax.Array,  # [B]
    page_table: jax.Array,  # [B, R]
    *,
    layer: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    block_sizes: PrefillBlockSizes | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [B, T, N, D]
    """Plain-jnp paged prefill attention: gathers each row's pages, materialises [T, R * S], f32 softmax."""
    del block_sizes, interpret
    _check_cache(q, k_pages, v_pages, page_table, layer, sliding_window, logit_softcap, k_scale, v_scale)
    if q.ndim != 4:
        raise ValueError(f"q must be [rows, q_len, num_heads, head_dim]; got {q.shape=}")
    num_rows, q_len, num_heads, head_dim = q.shape
    _check_table("q_start", q_start, num_rows)
    _check_table("kv_lens", kv_lens, num_rows)
    num_kv_heads = k_pages.shape[1]
    dtype = _compute_dtype(q, k_pages)
    k = _gather_pages(k_pages, k_scale, page_table, layer, dtype)  # [B, K, R * S, D]
    v = _gather_pages(v_pages, v_scale, page_table, layer, jnp.float32)
    num_keys = k.shape[2]
    kv_len = jnp.minimum(kv_lens, num_keys)[:, None, None]  # [B, 1, 1]
    q_pos = q_start[:, None, None] + jnp.arange(q_len)[None, :, None]  # [B, T, 1]
    k_pos = jnp.arange(num_keys)[None, None, :]  # [1, 1, R * S]
    key_valid = k_pos < kv_len  # [B, 1, R * S]
    visible = key_valid & (k_pos <= q_pos)  # [B, T, R * S]
    if sliding_window is not None:
        visible = visible & (k_pos > q_pos - sliding_window)
    qg = q.astype(dtype).reshape(num_rows, q_len, num_kv_heads, num_heads // num_kv_heads, head_dim)
    s = jnp.einsum("btkgd,bkmd->bkgtm", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if logit_softcap is not None:
        s = logit_softcap * jnp.tanh(s / logit_softcap)
    v = jnp.where(key_valid[:, :, :, None], v, 0.0)  # [B, K, R * S, D]; slots past kv_len may hold anything
    p = _masked_softmax(s, visible[:, None, None])
    out = jnp.einsum("bkgtm,bkmd->btkgd", p, v)  # [B, T, K, G, D]
    return out.reshape(num_rows, q_len, num_heads, head_dim).astype(q.dtype)
