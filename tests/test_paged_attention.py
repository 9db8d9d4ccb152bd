"""paged_decode_attention / paged_prefill_attention (Pallas, interpret mode on CPU) against their plain-jnp
references and against an independent dense oracle: random K/V are drawn as a contiguous [L, B, K, len, D]
array, scattered into random non-contiguous pages of a pool whose other pages hold garbage, and attention
is recomputed in float64 numpy on the contiguous array.

Every layer holds different random data (reading the wrong layer fails), page 0 is a null page never
owned by a row, and page-table entries a row does not need hold random page ids. In interpret mode
Pallas starts every output buffer as NaN (tests/test_flash_attention.py checks this), so `all finite`
means every element was written.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import export_for_platform
from pallas_kernels.int8_matmul import quantize_kv_int8
from pallas_kernels.paged_attention import (
    DecodeBlockSizes,
    PrefillBlockSizes,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

INTERPRET = True
# The page loop's two forms: the pool as one kernel block (GPU, interpret mode), and the TPU form (the pool
# in HBM, each step's pages copied into VMEM by double-buffered DMA) run by TPU interpret mode, which
# simulates the copies and semaphores and fills scratch with NaN.
FORMS = {"pool_block": INTERPRET, "tpu_dma": pltpu.InterpretParams()}
F32, BF16, I8 = jnp.float32, jnp.bfloat16, jnp.int8


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _tolerance(q_dtype, cache_dtype):
    """Float32 compute is exact up to rounding; bfloat16 compute (bf16 q with bf16 / int8 pages) is not."""
    compute = q_dtype if cache_dtype == I8 else jnp.promote_types(q_dtype, cache_dtype)
    return 1e-5 if compute == F32 else 1e-2


def _paged_cache(seed, *, layers, kv_heads, page_size, head_dim, row_lens, pages_per_row, dtype, poison):
    """Random contiguous K/V scattered into a shuffled page pool.

    Returns (cache kwargs for the kernels, page_table, dense K/V [2, L, B, K, M, D] float64 holding the
    values the pool stores, the same before int8 quantisation). Slots of the pool no row owns (whole pages,
    the tail of a row's last page, the null page 0) hold garbage: NaN if `poison`, else random values.
    """
    rng = np.random.default_rng(seed)
    num_rows = len(row_lens)
    max_len = pages_per_row * page_size
    num_pages = 1 + num_rows * pages_per_row + 3
    raw = rng.standard_normal((2, layers, num_rows, kv_heads, max_len, head_dim)).astype(np.float32)
    pool_shape = (2, layers, kv_heads, num_pages, page_size, head_dim)
    if dtype == I8:
        values_q, scales = (np.asarray(a) for a in quantize_kv_int8(jnp.asarray(raw)))
        dense = values_q.astype(np.float64) * scales[..., None]
        pool = rng.integers(-127, 128, pool_shape).astype(np.int8)
        pool_scale = np.full(pool_shape[:-1], np.nan, np.float32)
        if not poison:
            pool_scale = rng.uniform(0.5, 2.0, pool_shape[:-1]).astype(np.float32)
    else:
        values_q = np.asarray(jnp.asarray(raw, dtype).astype(F32))  # the values a `dtype` pool holds
        dense = values_q.astype(np.float64)
        pool = np.full(pool_shape, np.nan, np.float32)
        if not poison:
            pool = 3.0 * rng.standard_normal(pool_shape).astype(np.float32)

    physical = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page: never owned
    page_table = rng.integers(0, num_pages, (num_rows, pages_per_row)).astype(np.int32)
    owned = 0
    for b, length in enumerate(row_lens):
        for i in range(-(-length // page_size)):
            page, start = physical[owned], i * page_size
            owned += 1
            page_table[b, i] = page
            valid = min(page_size, length - start)
            pool[:, :, :, page, :valid] = values_q[:, :, b, :, start : start + valid]
            if dtype == I8:
                pool_scale[:, :, :, page, :valid] = scales[:, :, b, :, start : start + valid]

    cache = dict(k_pages=jnp.asarray(pool[0], dtype), v_pages=jnp.asarray(pool[1], dtype))
    if dtype == I8:
        cache.update(k_scale=jnp.asarray(pool_scale[0]), v_scale=jnp.asarray(pool_scale[1]))
    return cache, jnp.asarray(page_table), dense, raw.astype(np.float64)


def _softmax_rows(q, k, v, sm_scale, logit_softcap):
    """q [G, D] over k, v [j, D] (the visible keys only), float64."""
    s = q @ k.T * sm_scale
    if logit_softcap is not None:
        s = logit_softcap * np.tanh(s / logit_softcap)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _dense_decode(q, k, v, lengths, sm_scale, sliding_window, logit_softcap):
    """q [B, N, D]; k, v [B, K, M, D] contiguous; the query of row b sits at lengths[b] - 1."""
    q = np.asarray(q, np.float64)
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for b, length in enumerate(lengths):
        if length == 0:
            continue
        lo = 0 if sliding_window is None else max(0, length - sliding_window)
        for h in range(num_kv_heads):
            rows = slice(h * group, (h + 1) * group)
            out[b, rows] = _softmax_rows(
                q[b, rows], k[b, h, lo:length], v[b, h, lo:length], sm_scale, logit_softcap
            )
    return out


def _dense_prefill(q, k, v, q_start, true_lens, sm_scale, sliding_window, logit_softcap):
    """q [B, T, N, D]; outputs of the real (non-padding) queries t < true_lens[b], zeros elsewhere."""
    q = np.asarray(q, np.float64)
    num_rows, q_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for b in range(num_rows):
        for t in range(true_lens[b]):
            pos = q_start[b] + t
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            for h in range(num_kv_heads):
                rows = slice(h * group, (h + 1) * group)
                keys, values = k[b, h, lo : pos + 1], v[b, h, lo : pos + 1]
                out[b, t, rows] = _softmax_rows(q[b, t, rows], keys, values, sm_scale, logit_softcap)
    return out


# (heads, kv_heads, page_size, head_dim, lengths, pages_per_row, layers, layer, window, softcap, splits,
#  pages_per_block, q dtype, cache dtype, poison)
DECODE_CASES = {
    "gqa3_smollm": (9, 3, 8, 64, (0, 1, 13, 37), 6, 2, 1, None, None, 1, 2, F32, F32, True),
    "mqa_d128_window_layer2": (4, 1, 16, 128, (45, 16, 7), 4, 3, 2, 10, None, 1, None, F32, F32, False),
    "gqa4_softcap_splits": (8, 2, 8, 64, (29, 0, 64, 3), 8, 2, 0, None, 5.0, 3, 1, F32, F32, True),
    "gqa3_window_splits_ppb4": (9, 3, 16, 64, (77, 30), 5, 2, 1, 20, 30.0, 2, 4, F32, F32, False),
    "bf16_gqa4_d128": (8, 2, 16, 128, (33, 50, 1), 4, 2, 1, None, None, 1, None, BF16, BF16, True),
    "f32_q_bf16_pages_window": (9, 3, 8, 64, (21, 40), 5, 2, 1, 16, None, 1, 2, F32, BF16, False),
    "int8_window_softcap_splits": (9, 3, 16, 64, (37, 0, 50), 4, 3, 2, 24, 20.0, 2, 2, F32, I8, True),
    "int8_bf16_q_mqa_d128": (4, 1, 8, 128, (19, 31), 4, 2, 1, None, None, 1, 4, BF16, I8, False),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_matches_reference_and_dense(case, form):
    (heads, kv_heads, page_size, head_dim, lengths, pages_per_row, layers, layer, window, softcap, splits,
     pages_per_block, q_dtype, cache_dtype, poison) = DECODE_CASES[case]  # fmt: skip
    cache, page_table, dense, raw = _paged_cache(
        1, layers=layers, kv_heads=kv_heads, page_size=page_size, head_dim=head_dim, row_lens=lengths,
        pages_per_row=pages_per_row, dtype=cache_dtype, poison=poison,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, head_dim)), q_dtype)
    kwargs = dict(
        layer=layer,
        sm_scale=head_dim**-0.5,
        sliding_window=window,
        logit_softcap=softcap,
        num_splits=splits,
        block_sizes=None if pages_per_block is None else DecodeBlockSizes(pages_per_block),
        **cache,
    )
    lengths_arr = jnp.asarray(lengths, jnp.int32)
    out = paged_decode_attention(
        q, lengths=lengths_arr, page_table=page_table, interpret=FORMS[form], **kwargs
    )
    ref = paged_decode_attention_reference(q, lengths=lengths_arr, page_table=page_table, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    out32 = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out32))
    assert np.all(out32[np.asarray(lengths) == 0] == 0.0)
    tolerance = _tolerance(q_dtype, cache_dtype)
    assert _rel_err(out, ref) < tolerance
    oracle = functools.partial(
        _dense_decode,
        q,
        lengths=lengths,
        sm_scale=head_dim**-0.5,
        sliding_window=window,
        logit_softcap=softcap,
    )
    assert _rel_err(out, oracle(dense[0, layer], dense[1, layer])) < tolerance
    if cache_dtype == I8:  # against the unquantised values: within the int8 quantisation error
        assert _rel_err(out, oracle(raw[0, layer], raw[1, layer])) < 2e-2


# (heads, kv_heads, page_size, head_dim, q_len, q_start, true chunk lengths, pages_per_row, layers, layer,
#  window, softcap, blocks, q dtype, cache dtype, poison); kv_lens = q_start + true lengths.
PREFILL_CASES = {
    "gqa3_cached_prefix": (
        9, 3, 8, 64, 13, (0, 9, 20), (13, 7, 13), 5, 2, 1, None, None, (4, 2), F32, F32, True,
    ),
    "mqa_d128_window_layer2_empty_row": (
        4, 1, 16, 128, 11, (5, 0, 0), (11, 3, 0), 3, 3, 2, 6, None, (8, 1), F32, F32, False,
    ),
    "gqa4_softcap_default_blocks": (
        8, 2, 16, 64, 21, (0, 30), (21, 21), 4, 2, 0, None, 10.0, None, F32, F32, True,
    ),
    "bf16_gqa4_window": (8, 2, 8, 64, 9, (17, 0), (9, 9), 4, 2, 1, 8, None, (4, 2), BF16, BF16, False),
    "f32_q_bf16_pages": (9, 3, 16, 64, 7, (3,), (7,), 2, 2, 1, None, None, (8, 2), F32, BF16, True),
    "int8_window_softcap": (9, 3, 8, 64, 10, (0, 14), (10, 6), 4, 3, 1, 5, 20.0, (4, 2), F32, I8, True),
}  # fmt: skip


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_matches_reference_and_dense(case, form):
    (heads, kv_heads, page_size, head_dim, q_len, q_start, true_lens, pages_per_row, layers, layer, window,
     softcap, blocks, q_dtype, cache_dtype, poison) = PREFILL_CASES[case]  # fmt: skip
    kv_lens = tuple(start + n for start, n in zip(q_start, true_lens))
    cache, page_table, dense, raw = _paged_cache(
        3, layers=layers, kv_heads=kv_heads, page_size=page_size, head_dim=head_dim, row_lens=kv_lens,
        pages_per_row=pages_per_row, dtype=cache_dtype, poison=poison,
    )  # fmt: skip
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((len(q_start), q_len, heads, head_dim)), q_dtype)
    kwargs = dict(
        layer=layer,
        sm_scale=head_dim**-0.5,
        sliding_window=window,
        logit_softcap=softcap,
        block_sizes=None if blocks is None else PrefillBlockSizes(*blocks),
        **cache,
    )
    tables = dict(
        q_start=jnp.asarray(q_start, jnp.int32),
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        page_table=page_table,
    )
    out = paged_prefill_attention(q, interpret=FORMS[form], **tables, **kwargs)
    ref = paged_prefill_attention_reference(q, **tables, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))  # padding queries too
    tolerance = _tolerance(q_dtype, cache_dtype)
    assert _rel_err(out, ref) < tolerance
    # The oracle only defines real queries: zero the padding ones (t >= true length) before comparing.
    real = np.arange(q_len)[None, :] < np.asarray(true_lens)[:, None]  # [B, T]
    out_real = np.where(real[:, :, None, None], np.asarray(out, np.float64), 0.0)
    oracle = functools.partial(
        _dense_prefill, q, q_start=q_start, true_lens=true_lens, sm_scale=head_dim**-0.5,
        sliding_window=window, logit_softcap=softcap,
    )  # fmt: skip
    assert _rel_err(out_real, oracle(dense[0, layer], dense[1, layer])) < tolerance
    if cache_dtype == I8:
        assert _rel_err(out_real, oracle(raw[0, layer], raw[1, layer])) < 2e-2


def test_reads_only_needed_page_table_entries():
    # Page-table entries no visible key needs (before each row's window, past its length) point past the
    # pool. The TPU interpreter raises on any out-of-bounds read or DMA, so following one of them fails the
    # test; this runs the TPU form, whose DMAs name the pages they copy.
    page_size, window, pages_per_row = 8, 12, 6
    lengths, q_start, true_lens = (40, 0, 9, 47), (28, 0, 0, 40), (12, 0, 9, 7)
    cache, page_table, dense, _ = _paged_cache(
        5, layers=2, kv_heads=2, page_size=page_size, head_dim=64, row_lens=lengths,
        pages_per_row=pages_per_row, dtype=F32, poison=True,
    )  # fmt: skip
    out_of_pool = cache["k_pages"].shape[2] + 100
    table = np.asarray(page_table).copy()
    for b, length in enumerate(lengths):
        first = max(0, min(q_start[b], length) - window + 1) // page_size  # earliest query's window
        table[b, :first] = out_of_pool
        table[b, -(-length // page_size) :] = out_of_pool
    strict = pltpu.InterpretParams(out_of_bounds_reads="raise")
    rng = np.random.default_rng(6)
    common = dict(layer=1, sm_scale=0.125, sliding_window=window, page_table=jnp.asarray(table), **cache)

    q = jnp.asarray(rng.standard_normal((4, 4, 64)), F32)
    out = paged_decode_attention(
        q, lengths=jnp.asarray(lengths, jnp.int32), num_splits=2, block_sizes=DecodeBlockSizes(2),
        interpret=strict, **common,
    )  # fmt: skip
    expected = _dense_decode(q, dense[0, 1], dense[1, 1], lengths, 0.125, window, None)
    assert _rel_err(out, expected) < 1e-5

    q = jnp.asarray(rng.standard_normal((4, 12, 4, 64)), F32)
    out = paged_prefill_attention(
        q, q_start=jnp.asarray(q_start, jnp.int32), kv_lens=jnp.asarray(lengths, jnp.int32),
        block_sizes=PrefillBlockSizes(4, 2), interpret=strict, **common,
    )  # fmt: skip
    real = np.arange(12)[None, :] < np.asarray(true_lens)[:, None]
    out_real = np.where(real[:, :, None, None], np.asarray(out, np.float64), 0.0)
    expected = _dense_prefill(q, dense[0, 1], dense[1, 1], q_start, true_lens, 0.125, window, None)
    assert _rel_err(out_real, expected) < 1e-5


def _small_inputs(dtype=F32, head_dim=64, page_size=8):
    pages = jnp.ones((2, 2, 5, page_size, head_dim), dtype)
    return dict(
        q=jnp.ones((2, 4, head_dim), F32),
        k_pages=pages,
        v_pages=pages,
        lengths=jnp.ones((2,), jnp.int32),
        page_table=jnp.zeros((2, 3), jnp.int32),
        layer=0,
        sm_scale=1.0,
        interpret=INTERPRET,
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"head_dim": 96},
        {"page_size": 12},  # not a power of two
        {"page_size": 4},  # smaller than a matmul operand
        {"layer": 2},  # only 2 layers
        {"sliding_window": 0},
        {"logit_softcap": -1.0},
        {"num_splits": 0},
        {"q": jnp.ones((2, 3, 64), F32)},  # 3 heads over 2 kv heads
        {"q": jnp.ones((2, 4, 64), jnp.float16)},
        {"lengths": jnp.ones((3,), jnp.int32)},
        {"page_table": jnp.zeros((3, 3), jnp.int32)},
        {"page_table": jnp.zeros((2, 3), jnp.float32)},
        {"dtype": I8},  # int8 pages without scales
        {"k_scale": jnp.ones((2, 2, 5, 8)), "v_scale": jnp.ones((2, 2, 5, 8))},  # scales for float pages
        {"dtype": I8, "k_scale": jnp.ones((2, 2, 5, 8)), "v_scale": jnp.ones((2, 2, 5))},
    ],
)
def test_decode_invalid_inputs_raise(changes):
    changes = dict(changes)
    shape_changes = {
        name: changes.pop(name) for name in ("dtype", "head_dim", "page_size") if name in changes
    }
    kwargs = {**_small_inputs(**shape_changes), **changes}
    with pytest.raises(ValueError):
        paged_decode_attention(**kwargs)
    with pytest.raises(ValueError):
        paged_decode_attention_reference(**kwargs)


def test_prefill_invalid_inputs_raise():
    inputs = _small_inputs()
    del inputs["lengths"]
    tables = dict(q_start=jnp.zeros((2,), jnp.int32), kv_lens=jnp.ones((2,), jnp.int32))
    q = jnp.ones((2, 5, 4, 64), F32)
    with pytest.raises(ValueError):  # decode-shaped q
        paged_prefill_attention(**{**inputs, **tables})
    with pytest.raises(ValueError):
        paged_prefill_attention(**{**inputs, **tables, "q": q, "kv_lens": jnp.ones((3,), jnp.int32)})
    with pytest.raises(ValueError):  # 1 query per block x 1 head: fewer rows than a matmul operand
        paged_prefill_attention(
            **{**inputs, **tables, "q": q[:, :, :2], "block_sizes": PrefillBlockSizes(2, 1)}
        )


def test_block_sizes_validated():
    with pytest.raises(ValueError):
        DecodeBlockSizes(pages_per_block=3)
    with pytest.raises(ValueError):
        PrefillBlockSizes(block_q=24)
    assert PrefillBlockSizes.get_default(64, 16, 64, q_len=5, group=3).block_q * 4 >= 8
    assert DecodeBlockSizes.get_default(64, 16, pages_per_split=3).pages_per_block == 4


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu(platform):
    # Pallas -> Triton / Mosaic lowering without the hardware: catches unsupported ops and block shapes.
    spec = jax.ShapeDtypeStruct
    pages, scale = spec((3, 2, 64, 16, 128), I8), spec((3, 2, 64, 16), F32)
    table, rows = spec((5, 12), jnp.int32), spec((5,), jnp.int32)
    common = dict(layer=2, sm_scale=0.1, sliding_window=99, logit_softcap=30.0)

    def decode(q, k, v, ks, vs, lengths, page_table):
        return paged_decode_attention(
            q, k, v, lengths, page_table, k_scale=ks, v_scale=vs, num_splits=2, **common
        )

    def prefill(q, k, v, start, lens, page_table):
        return paged_prefill_attention(q, k, v, start, lens, page_table, **common)

    bf16_pages = spec(pages.shape, BF16)
    decode_args = (spec((5, 6, 128), BF16), pages, pages, scale, scale, rows, table)
    prefill_args = (spec((5, 50, 6, 128), BF16), bf16_pages, bf16_pages, rows, rows, table)
    exported = [
        export_for_platform(decode, platform, *decode_args),
        export_for_platform(prefill, platform, *prefill_args),
    ]
    for e in exported:
        assert ("triton" if platform == "cuda" else "tpu_custom_call") in e.mlir_module()
