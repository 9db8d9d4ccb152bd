"""decode_attention (Pallas, interpret mode on CPU) against decode_attention_reference, and the reference
against a naive per-slot softmax written with numpy loops.

In interpret mode Pallas starts every output buffer as NaN (tests/test_flash_attention.py checks this), so
`all finite` means every element was written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import export_for_platform
from pallas_kernels.decode_attention import BlockSizes, decode_attention, decode_attention_reference

INTERPRET = True
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(seed, num_layers, num_slots, num_heads, num_kv_heads, max_len, head_dim, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    cache_shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
    q = jax.random.normal(kq, (num_slots, num_heads, head_dim), jnp.float32).astype(dtype)
    k_cache = jax.random.normal(kk, cache_shape, jnp.float32).astype(dtype)
    v_cache = jax.random.normal(kv, cache_shape, jnp.float32).astype(dtype)
    return q, k_cache, v_cache


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _naive_decode(q, k_cache, v_cache, lengths, layer, sm_scale, sliding_window, logit_softcap):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k_cache[layer], v_cache[layer]))
    num_slots, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros_like(q)
    for b in range(num_slots):
        pos = int(lengths[b]) - 1
        keys = [j for j in range(int(lengths[b])) if sliding_window is None or j > pos - sliding_window]
        for h in range(num_heads):
            if not keys:
                continue
            s = np.array([q[b, h] @ k[b, h // group, j] for j in keys]) * sm_scale
            if logit_softcap is not None:
                s = logit_softcap * np.tanh(s / logit_softcap)
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[b, h // group, keys]
    return out


@pytest.mark.parametrize("sliding_window, logit_softcap", [(None, None), (4, None), (None, 3.0)])
def test_reference_matches_naive(sliding_window, logit_softcap):
    q, k_cache, v_cache = _inputs(0, 2, 4, 4, 2, 12, 64, jnp.float32)
    lengths = np.array([0, 1, 7, 12])
    kwargs = dict(layer=1, sm_scale=0.3, sliding_window=sliding_window, logit_softcap=logit_softcap)
    ref = decode_attention_reference(q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), **kwargs)
    naive = _naive_decode(q, k_cache, v_cache, lengths, **kwargs)
    np.testing.assert_allclose(np.asarray(ref), naive, rtol=1e-5, atol=1e-5)


# (layers, slots, heads, kv_heads, max_len, head_dim, lengths, layer, window, softcap, splits, bucket,
#  dtype, block_k)
CASES = {
    "gqa_ragged": (2, 4, 8, 2, 64, 64, (0, 1, 37, 64), 1, None, None, 1, None, jnp.float32, 16),
    "gqa_splits": (1, 4, 8, 2, 96, 64, (5, 50, 96, 17), 0, None, None, 3, None, jnp.float32, 16),
    "mqa_window_splits": (2, 3, 4, 1, 64, 64, (64, 30, 9), 0, 12, None, 4, None, jnp.float32, 8),
    "mha_softcap_bucket": (2, 3, 2, 2, 96, 64, (33, 0, 64), 1, None, 5.0, 2, 64, jnp.float32, 16),
    "bf16_gqa_d128": (1, 2, 4, 2, 48, 128, (48, 23), 0, None, None, 2, None, jnp.bfloat16, 8),
    "bf16_mqa_d256_window_default_blocks": (
        1,
        2,
        4,
        1,
        64,
        256,
        (64, 40),
        0,
        16,
        30.0,
        1,
        None,
        jnp.bfloat16,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    (
        layers,
        slots,
        heads,
        kv_heads,
        max_len,
        head_dim,
        lengths,
        layer,
        window,
        softcap,
        splits,
        bucket,
        dtype,
        block_k,
    ) = CASES[case]
    q, k_cache, v_cache = _inputs(1, layers, slots, heads, kv_heads, max_len, head_dim, dtype)
    lengths = jnp.array(lengths, jnp.int32)
    kwargs = dict(
        layer=layer,
        sm_scale=head_dim**-0.5,
        sliding_window=window,
        logit_softcap=softcap,
        num_splits=splits,
        max_len_bucket=bucket,
        block_sizes=None if block_k is None else BlockSizes(block_k),
    )
    out = decode_attention(q, k_cache, v_cache, lengths, interpret=INTERPRET, **kwargs)
    ref = decode_attention_reference(q, k_cache, v_cache, lengths, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel_err(out, ref) < TOLERANCE[dtype]
    inactive = np.asarray(lengths) == 0
    assert np.all(np.asarray(out, np.float32)[inactive] == 0.0)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_reads_only_valid_blocks_of_its_layer_and_slot(num_splits):
    # Every cache entry the kernel must not load is NaN: other layers, blocks past each slot's length and
    # blocks before its sliding window. Loading any of them would turn the output NaN (0 * NaN = NaN).
    block_k, max_len, window = 8, 64, 10
    q, k_cache, v_cache = _inputs(2, 3, 4, 4, 2, max_len, 64, jnp.float32)
    lengths = np.array([0, 5, 29, 64])
    kwargs = dict(
        layer=1, sm_scale=0.125, sliding_window=window, num_splits=num_splits, block_sizes=BlockSizes(block_k)
    )
    ref = decode_attention_reference(q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), **kwargs)
    keep = np.zeros(k_cache.shape, bool)
    for b, length in enumerate(lengths):
        if length:
            first_block = max(0, length - window) // block_k
            last_block = -(-length // block_k)
            keep[1, b, :, first_block * block_k : last_block * block_k] = True
    k_poisoned = jnp.where(keep, k_cache, jnp.nan)
    v_poisoned = jnp.where(keep, v_cache, jnp.nan)
    out = decode_attention(
        q, k_poisoned, v_poisoned, jnp.asarray(lengths, jnp.int32), interpret=INTERPRET, **kwargs
    )
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "kwargs",
    [
        {"layer": 2},  # only 2 layers
        {"layer": 0, "num_splits": 3},  # 64 not a multiple of 3 splits
        {"layer": 0, "max_len_bucket": 128},  # bucket larger than the cache
        {"layer": 0, "block_sizes": BlockSizes(128), "max_len_bucket": 32},  # block larger than the split
        {"layer": 0, "sliding_window": 0},
    ],
)
def test_invalid_inputs_raise(kwargs):
    q, k_cache, v_cache = _inputs(3, 2, 2, 4, 2, 64, 64, jnp.float32)
    with pytest.raises(ValueError):
        decode_attention(
            q, k_cache, v_cache, jnp.ones((2,), jnp.int32), sm_scale=1.0, interpret=INTERPRET, **kwargs
        )


def test_mismatched_shapes_raise():
    q, k_cache, v_cache = _inputs(4, 1, 2, 4, 2, 16, 64, jnp.float32)
    with pytest.raises(ValueError):
        decode_attention(q[:, :3], k_cache, v_cache, jnp.ones((2,), jnp.int32), layer=0, sm_scale=1.0)
    with pytest.raises(ValueError):
        decode_attention(q, k_cache, v_cache, jnp.ones((3,), jnp.int32), layer=0, sm_scale=1.0)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu(platform):
    # Pallas -> Triton / Mosaic lowering without the hardware: catches unsupported ops and block shapes.
    spec = jax.ShapeDtypeStruct
    cache = spec((3, 5, 2, 512, 128), jnp.bfloat16)
    kwargs = dict(layer=2, sm_scale=0.1, num_splits=2, sliding_window=99)
    exported = export_for_platform(
        lambda q, k, v, n: decode_attention(q, k, v, n, **kwargs),
        platform,
        spec((5, 8, 128), jnp.bfloat16),
        cache,
        cache,
        spec((5,), jnp.int32),
    )
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in exported.mlir_module()
