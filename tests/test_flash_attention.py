"""flash_attention (Pallas, interpret mode on CPU) against flash_attention_reference, and the reference
against a naive per-query softmax written with numpy loops.

In interpret mode Pallas starts every output buffer as NaN (checked below), so `all finite` means every
element was written by the kernel.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels._common import export_for_platform
from pallas_kernels.flash_attention import BlockSizes, flash_attention, flash_attention_reference

INTERPRET = True
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(seed, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim, dtype):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, num_heads, q_len, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, num_kv_heads, kv_len, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, num_kv_heads, kv_len, head_dim), jnp.float32).astype(dtype)
    return q, k, v


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _naive_attention(q, k, v, q_offsets, kv_lengths, sm_scale, causal, sliding_window, logit_softcap):
    """Per (batch, head, query) softmax over the visible keys, float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    batch, num_heads, q_len, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(num_heads):
            for t in range(q_len):
                pos = int(q_offsets[b]) + t
                keys = [
                    j
                    for j in range(int(kv_lengths[b]))
                    if (not causal or j <= pos) and (sliding_window is None or j > pos - sliding_window)
                ]
                if not keys:
                    continue
                s = np.array([q[b, h, t] @ k[b, h // group, j] for j in keys]) * sm_scale
                if logit_softcap is not None:
                    s = logit_softcap * np.tanh(s / logit_softcap)
                p = np.exp(s - s.max())
                out[b, h, t] = (p / p.sum()) @ v[b, h // group, keys]
    return out


def test_interpret_mode_poisons_unwritten_outputs():
    def kernel(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...]

    x = jnp.ones((16, 8), jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(2,),
        in_specs=[pl.BlockSpec((8, 8), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        interpret=INTERPRET,
    )(x)
    assert np.all(np.asarray(out[:8]) == 1.0) and np.all(np.isnan(np.asarray(out[8:])))


@pytest.mark.parametrize(
    "causal, sliding_window, logit_softcap", [(True, None, None), (True, 3, None), (False, None, 2.0)]
)
def test_reference_matches_naive(causal, sliding_window, logit_softcap):
    q, k, v = _inputs(0, 2, 4, 2, 5, 9, 64, jnp.float32)
    q_offsets, kv_lengths = np.array([0, 3]), np.array([5, 8])
    kwargs = dict(sm_scale=0.3, causal=causal, sliding_window=sliding_window, logit_softcap=logit_softcap)
    tables = dict(q_offsets=jnp.asarray(q_offsets), kv_lengths=jnp.asarray(kv_lengths))
    ref = flash_attention_reference(q, k, v, **tables, **kwargs)
    naive = _naive_attention(q, k, v, q_offsets, kv_lengths, **kwargs)
    np.testing.assert_allclose(np.asarray(ref), naive, rtol=1e-5, atol=1e-5)


# (batch, heads, kv_heads, q_len, kv_len, head_dim, q_offsets, kv_lengths, causal, window, softcap, dtype,
#  blocks)
CASES = {
    "mha_odd_lengths": (2, 2, 2, 40, 40, 64, (0, 0), (40, 29), True, None, None, jnp.float32, (16, 16)),
    "gqa_chunked_prefill": (2, 4, 2, 19, 48, 64, (0, 24), (19, 43), True, None, None, jnp.float32, (16, 16)),
    "mqa_window_softcap": (1, 4, 1, 45, 45, 64, (0,), (45,), True, 7, 20.0, jnp.float32, (16, 16)),
    "window_offset_gqa": (2, 4, 2, 21, 70, 64, (40, 9), (61, 30), True, 16, None, jnp.float32, (16, 32)),
    "non_causal_padding": (2, 2, 1, 12, 37, 64, (0, 0), (5, 33), False, None, None, jnp.float32, (16, 16)),
    "bf16_gqa_d128": (1, 4, 2, 33, 33, 128, (0,), (33,), True, None, None, jnp.bfloat16, (16, 16)),
    "bf16_mqa_d256_window_default_blocks": (
        1,
        2,
        1,
        50,
        50,
        256,
        (0,),
        (50,),
        True,
        20,
        30.0,
        jnp.bfloat16,
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    (
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
        q_offsets,
        kv_lengths,
        causal,
        window,
        softcap,
        dtype,
        blocks,
    ) = CASES[case]
    q, k, v = _inputs(1, batch, heads, kv_heads, q_len, kv_len, head_dim, dtype)
    kwargs = dict(
        q_offsets=jnp.array(q_offsets, jnp.int32),
        kv_lengths=jnp.array(kv_lengths, jnp.int32),
        sm_scale=head_dim**-0.5,
        causal=causal,
        sliding_window=window,
        logit_softcap=softcap,
        block_sizes=None if blocks is None else BlockSizes(*blocks),
    )
    out = flash_attention(q, k, v, interpret=INTERPRET, **kwargs)
    ref = flash_attention_reference(q, k, v, **kwargs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _rel_err(out, ref) < TOLERANCE[dtype]


def test_rows_without_visible_keys_are_zero():
    # Batch row 1 has no valid keys at all (kv_length 0): its queries see nothing and must give zeros.
    q, k, v = _inputs(2, 2, 2, 2, 20, 20, 64, jnp.float32)
    kwargs = dict(
        q_offsets=jnp.array([0, 0], jnp.int32),
        kv_lengths=jnp.array([20, 0], jnp.int32),
        sm_scale=0.125,
        block_sizes=BlockSizes(16, 16),
    )
    out = np.asarray(flash_attention(q, k, v, interpret=INTERPRET, **kwargs))
    assert np.all(np.isfinite(out)) and np.all(out[1] == 0.0)
    assert _rel_err(out[0], flash_attention_reference(q, k, v, **kwargs)[0]) < 1e-5


def test_fully_masked_key_blocks_are_not_loaded():
    # NaN in a value row poisons any block it is loaded with (0 * NaN = NaN), so whole key blocks that
    # must be skipped are NaN-filled: beyond kv_lengths (row 0) and before the sliding window (row 1).
    block = 16
    q, k, v = _inputs(3, 2, 2, 1, 16, 64, 64, jnp.float32)
    kwargs = dict(
        q_offsets=jnp.array([0, 48], jnp.int32),
        kv_lengths=jnp.array([32, 64], jnp.int32),
        sm_scale=0.125,
        causal=True,
        sliding_window=8,
        block_sizes=BlockSizes(block, block),
    )
    ref = flash_attention_reference(q, k, v, **kwargs)
    v = v.at[0, :, 2 * block :].set(jnp.nan).at[1, :, : 2 * block].set(jnp.nan)
    k = k.at[0, :, 2 * block :].set(jnp.nan).at[1, :, : 2 * block].set(jnp.nan)
    out = flash_attention(q, k, v, interpret=INTERPRET, **kwargs)
    assert np.all(np.isfinite(np.asarray(out)))
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(
    "shapes, kwargs",
    [
        (((1, 2, 8, 96), (1, 2, 8, 96)), {}),  # head_dim 96 unsupported
        (((1, 3, 8, 64), (1, 2, 8, 64)), {}),  # heads not a multiple of kv heads
        (((2, 2, 8, 64), (2, 2, 8, 64)), {"q_offsets": jnp.zeros((3,), jnp.int32)}),
        (((1, 2, 8, 64), (1, 2, 8, 64)), {"sliding_window": 0}),
    ],
)
def test_invalid_inputs_raise(shapes, kwargs):
    (q_shape, kv_shape) = shapes
    q, k = jnp.ones(q_shape), jnp.ones(kv_shape)
    batch = q_shape[0]
    call = functools.partial(flash_attention, q, k, k, sm_scale=1.0, interpret=INTERPRET)
    tables = {"q_offsets": jnp.zeros((batch,), jnp.int32), "kv_lengths": jnp.ones((batch,), jnp.int32)}
    kwargs = {**tables, **kwargs}
    with pytest.raises(ValueError):
        call(**kwargs)


def test_block_sizes_validated():
    with pytest.raises(ValueError):
        BlockSizes(block_q=24, block_k=16)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_lowers_for_gpu_and_tpu(platform):
    # Pallas -> Triton / Mosaic lowering without the hardware: catches unsupported ops and block shapes.
    spec = jax.ShapeDtypeStruct
    fn = functools.partial(flash_attention, sm_scale=0.1, sliding_window=64, logit_softcap=30.0)
    exported = export_for_platform(
        lambda q, k, v, offsets, lengths: fn(q, k, v, q_offsets=offsets, kv_lengths=lengths),
        platform,
        spec((2, 8, 300, 128), jnp.bfloat16),
        spec((2, 2, 300, 128), jnp.bfloat16),
        spec((2, 2, 300, 128), jnp.bfloat16),
        spec((2,), jnp.int32),
        spec((2,), jnp.int32),
    )
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in exported.mlir_module()
