"""The C++ decode-attention kernel (jaxinfer.cpu_kernels) against its JAX reference, and in the engine."""

from __future__ import annotations

import functools
import importlib
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cpu_kernels import (
    decode_attention_available,
    decode_attention_cpu,
    decode_attention_cpu_reference,
)
from jaxinfer.cpu_kernels.native_build import (
    AVX2,
    AVX512_VNNI,
    AVX_VNNI,
    ISAS,
    best_isa,
    cpu_description,
    cpu_supports,
    register_isa_kernels,
)

# The engine tests at the end import the engine inside themselves: the kernel's tests do not depend on it.

needs_kernel = pytest.mark.skipif(
    not decode_attention_available(), reason="needs an x86-64 CPU with AVX2 and g++"
)
_decode_attention = importlib.import_module("jaxinfer.cpu_kernels.decode_attention")
_int8_matmul = importlib.import_module("jaxinfer.cpu_kernels.int8_matmul_vnni")
# Every variant of the attention kernel this CPU runs (AVX-512 and AVX2 on an AVX-512 machine), each
# tested in this process.
CPU_ISAS = [isa.name for isa in _decode_attention.KERNEL.isas if cpu_supports(isa)]
KERNEL_VARIANTS = [
    (module, isa.name)
    for module in ["decode_attention", "int8_matmul_vnni", "int4_matmul", "grouped_matmul"]
    for isa in importlib.import_module(f"jaxinfer.cpu_kernels.{module}").KERNEL.isas
    if cpu_supports(isa)
]


# None (an empty set, skipped) only on a CPU with neither AVX2 nor AVX-512.
@pytest.mark.parametrize(("module", "isa"), KERNEL_VARIANTS)
def test_kernels_build_wherever_the_cpu_allows(module, isa):
    # Guards the skips of the native-kernel tests: a kernel variant that stops compiling must fail here,
    # not turn its tests into skips.
    if os.environ.get("JAXINFER_NATIVE_KERNELS", "1") == "0":
        pytest.skip("native kernels switched off (JAXINFER_NATIVE_KERNELS=0)")
    assert shutil.which(os.environ.get("CXX", "g++")), "no C++ compiler (g++ or $CXX) on an x86-64 CPU"
    kernel = importlib.import_module(f"jaxinfer.cpu_kernels.{module}").KERNEL
    variant = next(variant for variant in ISAS if variant.name == isa)
    assert register_isa_kernels(kernel.source, variant, kernel.symbols), f"the {isa} variant did not build"
    assert kernel.available(isa) and kernel.chosen_isa() == best_isa(kernel.isas) and kernel.available()


@pytest.mark.parametrize("isa", [isa.name for isa in ISAS if cpu_supports(isa)])
def test_the_benchmarks_cpu_line_names_the_kernel_variant_and_the_xla_cap(isa, monkeypatch):
    monkeypatch.setenv("JAXINFER_CPU_ISA", isa)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2")
    assert cpu_description().endswith(f"; native kernel ISA: {isa}; XLA AVX2")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert cpu_description().endswith("; native kernel ISA: none (XLA serves)")


def test_the_isa_cap_admits_that_isa_and_the_slower_ones_and_refuses_other_names(monkeypatch):
    monkeypatch.delenv("JAXINFER_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("JAXINFER_CPU_ISA", "avx_vnni")
    allowed = [isa for isa in (AVX_VNNI, AVX2) if cpu_supports(isa)]
    assert best_isa() == (allowed[0] if allowed else None)
    assert best_isa((AVX512_VNNI,)) is None  # above the cap
    monkeypatch.setenv("JAXINFER_CPU_ISA", "sse2")
    with pytest.raises(ValueError, match="JAXINFER_CPU_ISA='sse2' is not one of"):
        best_isa()


def _bf16_bits(x) -> jax.Array:
    return jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.bfloat16), jnp.uint16)


def _storage(x, cache_dtype: str) -> jax.Array:
    return _bf16_bits(x) if cache_dtype == "bf16bits" else jnp.asarray(x, jnp.float32)


def _int8_pages(rng, shape) -> tuple[jax.Array, jax.Array]:
    """Random int8 pages [..., d] and their positive per-position scales [...] (kv_cache.py's int8 form)."""
    pages = jnp.asarray(rng.integers(-127, 128, size=shape), jnp.int8)
    return pages, jnp.asarray(rng.uniform(0.002, 0.03, size=shape[:-1]), jnp.float32)


def _widen(pages: jax.Array) -> np.ndarray:
    if pages.dtype == jnp.uint16:
        pages = jax.lax.bitcast_convert_type(pages, jnp.bfloat16)
    return np.asarray(pages.astype(jnp.float32), np.float64)


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits", "int8"])
# (rows, kv heads, query heads, page size, pages per row, head dim, window, softcap): GQA groups of 3, 4,
# 9 (more than one pass of 8 heads), 3 and 7, 8; pages of 1, 16, 24, 64 and 128 positions; head dims
# taking each width of the value pass (16, 48: one 16-wide chunk; 32: two; 64, 256: four or two).
@pytest.mark.parametrize(
    "rows,kv,heads,page_size,width,dim,window,softcap",
    [
        (5, 2, 6, 16, 4, 32, None, None),
        (4, 1, 4, 1, 70, 256, 7, None),
        (3, 3, 27, 64, 2, 64, None, 30.0),
        (6, 1, 9, 24, 3, 16, 5, 20.0),
        (3, 2, 14, 16, 5, 48, 20, None),
        (2, 1, 8, 128, 2, 64, None, None),
    ],
)
def test_kernel_matches_its_reference(
    cache_dtype, rows, kv, heads, page_size, width, dim, window, softcap, isa
):
    rng = np.random.default_rng(page_size * 1000 + dim)
    pages = rows * width + 3
    shape = (2, kv, pages, page_size, dim)
    scales = {}
    if cache_dtype == "int8":
        (k, scales["k_scale"]), (v, scales["v_scale"]) = _int8_pages(rng, shape), _int8_pages(rng, shape)
    else:
        k, v = (_storage(rng.normal(size=shape), cache_dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(rows, heads, dim)) * 3.0, jnp.float32)  # peaked softmaxes too
    # Any page anywhere, shared or not: the table is all the kernel goes by.
    table = jnp.asarray(rng.integers(0, pages, size=(rows, width)), jnp.int32)
    # Every kind of row: the whole table, empty (inactive), one key, some keys.
    positions = width * page_size
    lengths = jnp.asarray(rng.integers(2, positions, size=rows), jnp.int32).at[0].set(positions)
    lengths = lengths.at[1].set(0) if rows > 2 else lengths.at[1].set(1)
    kwargs = dict(layer=1, scale=dim**-0.5, sliding_window=window, softcap=softcap, **scales)
    got = jax.jit(lambda *a: decode_attention_cpu(*a, **kwargs, isa=isa))(q, k, v, table, lengths)
    want = decode_attention_cpu_reference(q, k, v, table, lengths, **kwargs)
    assert got.shape == (rows, heads, dim) and got.dtype == jnp.float32
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
    if rows > 2:
        assert not np.asarray(got[1]).any()  # an inactive row's output is zeros


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits"])
@pytest.mark.parametrize("group", range(1, 10))
def test_every_gqa_group_size(cache_dtype, group, isa):
    rng = np.random.default_rng(group)
    rows, kv, dim, page_size, width = 3, 2, 64, 16, 3
    k, v = (_storage(rng.normal(size=(1, kv, 8, page_size, dim)), cache_dtype) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(rows, kv * group, dim)), jnp.float32)
    table = jnp.asarray(rng.integers(0, 8, size=(rows, width)), jnp.int32)
    lengths = jnp.asarray([48, 33, 5], jnp.int32)
    kwargs = dict(layer=0, scale=dim**-0.5, sliding_window=None, softcap=None)
    got = decode_attention_cpu(q, k, v, table, lengths, **kwargs, isa=isa)
    want = decode_attention_cpu_reference(q, k, v, table, lengths, **kwargs)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_extreme_scores(softcap, isa):
    # Scores in the thousands: exp's clamps at both ends (softmax weights below e^-87, and with a softcap
    # exp(2 s / softcap) far past float range, where tanh must come out exactly +-1).
    rng = np.random.default_rng(7)
    rows, kv, heads, dim, page_size = 3, 1, 4, 32, 16
    k, v = (jnp.asarray(rng.normal(size=(1, kv, 6, page_size, dim)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(rows, heads, dim)) * 300.0, jnp.float32)
    table = jnp.asarray(rng.permutation(6)[: 2 * rows].reshape(rows, 2), jnp.int32)
    lengths = jnp.asarray([32, 17, 3], jnp.int32)
    kwargs = dict(layer=0, scale=dim**-0.5, sliding_window=None, softcap=softcap)
    got = decode_attention_cpu(q, k, v, table, lengths, **kwargs, isa=isa)
    want = decode_attention_cpu_reference(q, k, v, table, lengths, **kwargs)
    assert np.isfinite(np.asarray(got)).all()
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5


def _scatter_into_pages(rng, dense: list[np.ndarray], lengths, page_size: int, layers: int, layer: int):
    """Random non-contiguous pages holding each dense [rows, kv, positions, d] (K, V) up to each row's
    length, in `layer` of pools whose page 0 (the null page), spare pages and slots past each row's
    last key are NaN, and whose other layers hold other garbage.
    -> pools [layers, kv, P, S, d], table [rows, W]."""
    rows, kv, _, dim = dense[0].shape
    need = [-(-n // page_size) for n in lengths]
    width = max(need) + 1  # a spare column past every row's end
    num_pages = 1 + sum(need) + 4  # the null page, each row's pages, 4 never used
    pools = [rng.normal(size=(layers, kv, num_pages, page_size, dim)) * 5.0 for _ in dense]
    for pool in pools:
        pool[layer] = np.nan
    ids = iter(rng.permutation(np.arange(1, num_pages)))
    table = rng.integers(0, num_pages, size=(rows, width))  # entries past a row's end: anything
    for r, n in enumerate(lengths):
        for i in range(need[r]):
            table[r, i] = page = next(ids)
            for pool, x in zip(pools, dense):
                chunk = x[r, :, i * page_size : min(n, (i + 1) * page_size)]
                pool[layer, :, page, : chunk.shape[1]] = chunk
    return pools, jnp.asarray(table, jnp.int32)


def _dense_attention(q, k, v, lengths, scale, window, softcap) -> np.ndarray:
    """Plain masked softmax attention, float64, over contiguous k, v [rows, kv, positions, d]."""
    rows, heads, dim = q.shape
    kv = k.shape[1]
    out = np.zeros((rows, heads, dim))
    for r, n in enumerate(lengths):
        start = max(0, n - window) if window else 0
        for h in range(heads):
            keys, values = k[r, h // (heads // kv), start:n], v[r, h // (heads // kv), start:n]
            if n == 0:
                continue
            s = keys @ q[r, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[r, h] = w @ values / w.sum()
    return out


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits"])
@pytest.mark.parametrize("page_size", [1, 16, 24, 64])
@pytest.mark.parametrize("window,softcap", [(None, None), (19, 25.0)])
def test_kernel_on_scattered_pages_matches_dense_attention(cache_dtype, page_size, window, softcap, isa):
    rng = np.random.default_rng(page_size)
    rows, kv, heads, dim, layer = 7, 2, 6, 64, 1
    # Lengths: empty, one key, a page exactly, a page and one, odd, long, not multiples of the page size.
    lengths = [0, 1, page_size, page_size + 1, 37, 2 * page_size + 3, 131]
    positions = max(lengths)
    dense_k, dense_v = (rng.normal(size=(rows, kv, positions, dim)) for _ in range(2))
    q = rng.normal(size=(rows, heads, dim)) * 2.0
    (k_pool, v_pool), table = _scatter_into_pages(rng, [dense_k, dense_v], lengths, page_size, 3, layer)
    k_pages, v_pages = _storage(k_pool, cache_dtype), _storage(v_pool, cache_dtype)
    # The dense keys and values as the pages store them (bfloat16-rounded where they are bf16 bits).
    dense_k, dense_v = (_widen(_storage(x, cache_dtype)) for x in (dense_k, dense_v))
    scale = dim**-0.5
    kwargs = dict(layer=layer, scale=scale, sliding_window=window, softcap=softcap)
    args = (jnp.asarray(q, jnp.float32), k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32))
    got = np.asarray(jax.jit(lambda *a: decode_attention_cpu(*a, **kwargs, isa=isa))(*args))
    want = _dense_attention(
        np.asarray(args[0], np.float64), dense_k, dense_v, lengths, scale, window, softcap
    )
    assert np.isfinite(got).all()  # no NaN page slot was read
    assert _rel(got, want) < 1e-5
    assert not got[0].any()
    reference = np.asarray(decode_attention_cpu_reference(*args, **kwargs))
    assert _rel(got, reference) < 1e-5 and _rel(reference, want) < 1e-5


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits", "int8"])
# Fewer KV heads than pool threads (on 2+ threads) and rows of 512 keys or more: the kernel cuts each
# row's keys into parts with their own softmaxes and merges them. Gemma 3's shape (one KV head, four
# query heads, head dim 256) and SmolLM2's (three KV heads, groups of 3: split where the pool has more
# threads than that); a split row beside a row too short to split, so the step's other parts of it are
# empty, an inactive row, a window, a softcap.
@pytest.mark.parametrize(
    "kv,heads,dim,lengths,window,softcap",
    [
        (1, 4, 256, [611], None, None),
        (1, 4, 256, [1117, 5], 600, 30.0),
        (3, 9, 64, [1000], None, None),
        (1, 3, 48, [777, 0, 129], None, 20.0),
    ],
)
def test_keys_split_into_parts_merge_exactly(cache_dtype, kv, heads, dim, lengths, window, softcap, isa):
    rng = np.random.default_rng(sum(lengths) + dim)
    rows, page_size, layer = len(lengths), 16, 0
    dense_k, dense_v = (rng.normal(size=(rows, kv, max(lengths), dim)) for _ in range(2))
    (k_pool, v_pool), table = _scatter_into_pages(rng, [dense_k, dense_v], lengths, page_size, 1, layer)
    scales = {}
    if cache_dtype == "int8":  # random int8 pools in the same page layout
        k_pages, scales["k_scale"] = _int8_pages(rng, k_pool.shape)
        v_pages, scales["v_scale"] = _int8_pages(rng, v_pool.shape)
    else:  # slots past each row's keys are NaN: no part may read them
        k_pages, v_pages = _storage(k_pool, cache_dtype), _storage(v_pool, cache_dtype)
    q = jnp.asarray(rng.normal(size=(rows, heads, dim)) * 2.0, jnp.float32)
    kwargs = dict(layer=layer, scale=dim**-0.5, sliding_window=window, softcap=softcap, **scales)
    args = (q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32))
    got = np.asarray(jax.jit(lambda *a: decode_attention_cpu(*a, **kwargs, isa=isa))(*args))
    want = np.asarray(decode_attention_cpu_reference(*args, **kwargs), np.float64)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 1e-5
    for r, n in enumerate(lengths):
        assert got[r].any() == (n > 0)  # an inactive row's output is zeros, an active row's is not


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["bf16bits", "int8"])
# A verification step's rows (the last token, then the drafts) share their sequence's table row, each
# attending up to its own position: Gemma 3's shape and SmolLM2's; rows past a sequence's drafts are
# inactive (length 0); a window; two sequences.
@pytest.mark.parametrize(
    "kv,heads,dim,bases,window",
    [(1, 4, 256, [700], None), (3, 9, 64, [301, 40], None), (1, 4, 256, [520], 512), (2, 6, 32, [90], 7)],
)
def test_verification_rows_attend_their_own_prefix(cache_dtype, kv, heads, dim, bases, window, isa):
    rng = np.random.default_rng(sum(bases) + dim)
    t, page_size, layer = 5, 16, 0
    live = [t, 3][: len(bases)]  # the second sequence verifies 2 drafts of 4: its last 2 rows are padding
    ends = [b + t for b in bases]
    dense_k, dense_v = (rng.normal(size=(len(bases), kv, max(ends), dim)) for _ in range(2))
    (k_pool, v_pool), table = _scatter_into_pages(rng, [dense_k, dense_v], ends, page_size, 1, layer)
    scales = {}
    if cache_dtype == "int8":
        k_pages, scales["k_scale"] = _int8_pages(rng, k_pool.shape)
        v_pages, scales["v_scale"] = _int8_pages(rng, v_pool.shape)
    else:
        k_pages, v_pages = _storage(k_pool, cache_dtype), _storage(v_pool, cache_dtype)
    lengths = [b + i + 1 if i < n else 0 for b, n in zip(bases, live) for i in range(t)]
    q = jnp.asarray(rng.normal(size=(len(lengths), heads, dim)) * 2.0, jnp.float32)
    kwargs = dict(layer=layer, scale=dim**-0.5, sliding_window=window, softcap=None, **scales)
    args = (q, k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32))
    attend = lambda *a: decode_attention_cpu(*a, **kwargs, queries_per_row=t, isa=isa)  # noqa: E731
    got = np.asarray(jax.jit(attend)(*args))
    want = np.asarray(decode_attention_cpu_reference(*args, **kwargs, queries_per_row=t), np.float64)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 1e-5
    for r, n in enumerate(lengths):
        assert got[r].any() == (n > 0)
        if n:  # each row's own answer, not its block neighbour's
            assert np.abs(got[r] - want[r]).max() < 1e-4 * max(1.0, np.abs(want[r]).max())


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("kv,heads,dim", [(1, 4, 256), (3, 9, 64)])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(kv, heads, dim, isa):
    # Bit for bit: a one-row decode step and the same query among a verification step's rows or a wider
    # batch (where Gemma 3's keys are cut into parts, the cut follows the row's own length alone).
    rng = np.random.default_rng(dim)
    page_size, width = 16, 40
    shape = (1, kv, width + 1, page_size, dim)
    k, v = (_storage(rng.normal(size=shape), "bf16bits") for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, width + 1))[None], jnp.int32)
    q = jnp.asarray(rng.normal(size=(6, heads, dim)), jnp.float32)
    lengths = jnp.asarray([601, 602, 603, 90, 604, 605], jnp.int32)
    kwargs = dict(layer=0, scale=dim**-0.5, sliding_window=None, softcap=None, isa=isa)
    alone = [
        np.asarray(decode_attention_cpu(q[i : i + 1], k, v, table, lengths[i : i + 1], **kwargs))
        for i in range(6)
    ]
    together = np.asarray(decode_attention_cpu(q, k, v, table, lengths, **kwargs, queries_per_row=6))
    batch = np.asarray(decode_attention_cpu(q, k, v, jnp.repeat(table, 6, axis=0), lengths, **kwargs))
    for i in range(6):
        assert np.array_equal(alone[i][0], together[i]) and np.array_equal(alone[i][0], batch[i]), i


@needs_kernel
def test_bad_shapes_are_refused_clearly():
    q = jnp.zeros((3, 4, 32), jnp.float32)
    pages = jnp.zeros((2, 2, 5, 16, 32), jnp.float32)
    table, lengths = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)
    kwargs = dict(layer=0, scale=1.0, sliding_window=None, softcap=None)
    with pytest.raises(ValueError, match="page_table"):
        decode_attention_cpu(q, pages, pages, table[:2], lengths, **kwargs)
    with pytest.raises(ValueError, match="layer"):
        decode_attention_cpu(q, pages, pages, table, lengths, **{**kwargs, "layer": 2})
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_attention_cpu(q[..., :24], pages[..., :24], pages[..., :24], table, lengths, **kwargs)
    with pytest.raises(ValueError, match="one shape"):
        decode_attention_cpu(q, pages, pages[:, :, :4], table, lengths, **kwargs)
    with pytest.raises(ValueError, match="unknown ISA"):
        decode_attention_cpu(q, pages, pages, table, lengths, **kwargs, isa="sse2")
    int8, scales = jnp.zeros(pages.shape, jnp.int8), jnp.ones(pages.shape[:-1], jnp.float32)
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention_cpu(q, int8, int8, table, lengths, **kwargs)  # int8 pages without their scales
    with pytest.raises(ValueError, match="v_scale"):
        decode_attention_cpu(q, int8, int8, table, lengths, **kwargs, k_scale=scales, v_scale=scales[..., :4])
    with pytest.raises(ValueError, match="k_scale"):
        decode_attention_cpu(q, pages, pages, table, lengths, **kwargs, k_scale=scales, v_scale=scales)
    # The FFI handler checks too, for callers that bypass the wrapper.
    target = _decode_attention.KERNEL.target(_decode_attention.SYMBOLS["float32"])
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    with pytest.raises(ValueError, match="page_table"):  # 3 rows are not 2 sequences of 2 queries
        decode_attention_cpu(q, pages, pages, table[:2], lengths, **kwargs, queries_per_row=2)
    with pytest.raises(Exception, match="page_table"):
        call(q, pages, pages, table[:2], lengths, layer=np.int64(0), window=np.int64(0),
             scale=np.float32(1.0), softcap=np.float32(0.0), queries_per_row=np.int64(1))  # fmt: skip
    with pytest.raises(Exception, match="queries_per_row"):
        call(q, pages, pages, table[:1], lengths, layer=np.int64(0), window=np.int64(0),
             scale=np.float32(1.0), softcap=np.float32(0.0), queries_per_row=np.int64(0))  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits"])
@pytest.mark.parametrize("window,softcap", [(None, None), (11, 25.0)])
def test_prefill_chunks_attend_causally_over_their_sequences_pages(cache_dtype, window, softcap, isa):
    # Two sequences, a chunk of t queries each over one table row apiece (queries_per_row = t): one
    # chunk continues a 29-token prefix, the other starts at 0 and is padded (length-0 rows) past 9.
    rng = np.random.default_rng(11)
    kv, heads, dim, page_size, layer, t = 2, 6, 32, 16, 1, 12
    starts, real = [29, 0], [12, 9]
    ends = [s + n for s, n in zip(starts, real)]
    dense_k, dense_v = (rng.normal(size=(2, kv, max(ends), dim)) for _ in range(2))
    (k_pool, v_pool), table = _scatter_into_pages(rng, [dense_k, dense_v], ends, page_size, 2, layer)
    k_pages, v_pages = _storage(k_pool, cache_dtype), _storage(v_pool, cache_dtype)
    dense_k, dense_v = (_widen(_storage(x, cache_dtype)) for x in (dense_k, dense_v))
    q = rng.normal(size=(2 * t, heads, dim)) * 2.0
    lengths = [s + i + 1 if i < n else 0 for s, n in zip(starts, real) for i in range(t)]
    kwargs = dict(layer=layer, scale=dim**-0.5, sliding_window=window, softcap=softcap)
    args = (jnp.asarray(q, jnp.float32), k_pages, v_pages, table, jnp.asarray(lengths, jnp.int32))
    attend = lambda *a: decode_attention_cpu(*a, **kwargs, queries_per_row=t, isa=isa)  # noqa: E731
    got = np.asarray(jax.jit(attend)(*args))
    per_query = [np.repeat(x, t, axis=0) for x in (dense_k, dense_v)]  # each query's sequence
    want = _dense_attention(np.asarray(args[0], np.float64), *per_query, lengths, dim**-0.5, window, softcap)
    assert np.isfinite(got).all() and _rel(got, want) < 1e-5
    assert not got[t + 9 :].any()  # padding queries give zeros
    reference = decode_attention_cpu_reference(*args, **kwargs, queries_per_row=t)
    assert _rel(got, np.asarray(reference, np.float64)) < 1e-5


@needs_kernel
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_through_the_kernel_equals_xla(arch, cache_dtype):
    from jaxinfer.config import KernelConfig
    from jaxinfer.evaluation import cache_for
    from jaxinfer.models.params import random_params
    from jaxinfer.models.transformer import forward
    from tests.test_engine import CONFIGS

    config = CONFIGS[arch]  # Gemma: sliding-window layers, a window of 7 inside each chunk
    params = random_params(config, seed=5)
    rng = np.random.default_rng(1)
    lengths, chunk = [37, 23], 16  # the second row's last chunk is all padding
    tokens = rng.integers(0, config.vocab_size, size=(2, 48)).astype(np.int32)
    positions = np.where(np.arange(48)[None] < np.array(lengths)[:, None], np.arange(48)[None], -1)

    def prefill(kernels: KernelConfig) -> np.ndarray:
        cache, table = cache_for(config, 2, 48, cache_dtype)
        step = jax.jit(functools.partial(forward, params, config, kernels=kernels))
        out = []
        for c in range(0, 48, chunk):
            window = slice(c, c + chunk)
            logits, cache = step(tokens[:, window], jnp.asarray(positions[:, window]), cache, table)
            out.append(np.asarray(logits))
        return np.concatenate(out, axis=1)

    native = prefill(KernelConfig(attention="native"))
    xla = prefill(KernelConfig())
    for row, n in enumerate(lengths):  # padding tokens' logits are nobody's
        rel = np.linalg.norm(native[row, :n] - xla[row, :n]) / np.linalg.norm(xla[row, :n])
        assert rel < 1e-4, (row, rel)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cached_decode_through_the_kernel_equals_full_recompute(arch, cache_dtype, rows):
    from jaxinfer.config import KernelConfig
    from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
    from jaxinfer.models.params import random_params
    from tests.test_engine import CONFIGS

    config = CONFIGS[arch]  # Gemma: sliding-window layers, a window of 7 passed by the end
    params = random_params(config, seed=3)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, size=20)]
    expected = teacher_forced_logits(params, config, tokens, KernelConfig())
    # One row attends natively where the runtime allows it (native int4 output projections).
    kernels = KernelConfig(attention="native", native_attention_min_rows=1)
    got = teacher_forced_decode_logits(params, config, tokens, kernels, rows=rows, cache_dtype=cache_dtype)
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < {"float32": 1e-5, "bfloat16": 1e-2, "int8": 2e-2}[cache_dtype], rel
    if cache_dtype == "int8":  # the same quantised pages through XLA's attention: only rounding apart
        xla = teacher_forced_decode_logits(
            params, config, tokens, KernelConfig(), rows=rows, cache_dtype="int8"
        )
        assert np.linalg.norm(got - xla) / np.linalg.norm(xla) < 1e-4


@needs_kernel
def test_engine_compiles_one_decode_program_per_row_bucket_with_the_kernel():
    from jaxinfer.config import KernelConfig
    from jaxinfer.jax_engine import JaxEngine
    from jaxinfer.models.params import random_params
    from jaxinfer.testing import paged_cache_config
    from tests.test_engine import CONFIGS

    config = CONFIGS["llama"]
    params = random_params(config, seed=0)
    cache = paged_cache_config(4, 128, page_size=16, dtype="bfloat16")
    native = JaxEngine(params, config, cache, max_prefill_chunk=16, kernels=KernelConfig(attention="native"))
    xla = JaxEngine(params, config, cache, max_prefill_chunk=16, kernels=KernelConfig())
    # One row stays on XLA attention (KernelConfig.native_attention_min_rows); 2 and 4 rows read each
    # row up to its own length, so the page buckets collapse to a whole page table.
    assert [native.native_attention(r) for r in (1, 2, 4)] == [False, True, True]
    one_row = KernelConfig(attention="native", native_attention_min_rows=1)
    assert JaxEngine(params, config, cache, kernels=one_row).native_attention(1)
    assert native._decode_page_buckets(4) == (8,) and len(xla._decode_page_buckets(4)) > 1
    assert native.decode_attend_len(4, 100) == 101
    assert xla.decode_attend_len(4, 100) % 16 == 0 and xla.decode_attend_len(4, 100) > 100
    native.warmup()
    xla.warmup()
    assert native.compile_count < xla.compile_count
    # int8 pages too: the kernel reads them with their scales.
    int8 = JaxEngine(params, config, paged_cache_config(4, 128, page_size=16, dtype="int8"),
                     kernels=KernelConfig(attention="native"))  # fmt: skip
    assert int8.native_attention(4) and int8._decode_page_buckets(4) == (8,)


@needs_kernel
def test_one_row_attends_natively_only_after_native_output_projections():
    from jaxinfer.config import KernelConfig
    from jaxinfer.kernel_dispatch import native_attention_min_rows
    from jaxinfer.models.params import random_params
    from jaxinfer.quantization import quantize_params
    from jaxinfer.runtime import add_kernel_forms
    from tests.test_engine import CONFIGS

    native = KernelConfig(attention="native", matmul="native")
    params = lambda: random_params(CONFIGS["llama"], seed=0)  # noqa: E731 (quantising consumes them)
    int4 = add_kernel_forms(quantize_params(params(), "int4"), native)["layers"]
    int8 = add_kernel_forms(quantize_params(params(), "int8"), native)["layers"]
    assert native_attention_min_rows(int4, native) == 1
    assert native_attention_min_rows(int8, native) == 1  # the VNNI kernel serves one row too
    assert all(layer["o_proj"].q is None for layer in int8)  # nothing reads the unpacked int8 bytes
    # An XLA matrix-vector product follows attention: float weights, or int4 / int8 through XLA.
    assert native_attention_min_rows(params()["layers"], native) == 2
    assert native_attention_min_rows(int4, KernelConfig(attention="native")) == 2
    xla_int8 = add_kernel_forms(quantize_params(params(), "int8"), KernelConfig(attention="native"))
    assert native_attention_min_rows(xla_int8["layers"], KernelConfig(attention="native")) == 2


def test_native_attention_is_refused_where_it_cannot_run():
    from jaxinfer.config import KernelConfig

    with pytest.raises(ValueError, match="one CPU device"):
        KernelConfig.for_backend("cpu", "native", single_device=False)
    with pytest.raises(ValueError, match="one CPU device"):
        KernelConfig.for_backend("gpu", "native")
    # auto never picks it there
    assert KernelConfig.for_backend("cpu", single_device=False).attention == "xla"
    assert KernelConfig.for_backend("cpu", single_device=False).matmul == "xla"
