"""int8_matmul (Pallas, interpret mode on CPU) against int8_matmul_reference; the reference against a
float64 numpy product; quantize_int8 / quantize_kv_int8 against their error bound.

In interpret mode Pallas starts every output buffer as NaN (tests/test_flash_attention.py checks this), so
`all finite` means every element was written.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import export_for_platform
from pallas_kernels.int8_matmul import (
    BlockSizes,
    dequantize_int8,
    dequantize_kv_int8,
    int8_matmul,
    int8_matmul_reference,
    quantize_int8,
    quantize_kv_int8,
)

INTERPRET = True
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _weights(seed, n, k):
    # Rows with very different magnitudes, so per-row scales matter.
    kw, ks = jax.random.split(jax.random.key(seed))
    row_scale = jnp.exp(jax.random.uniform(ks, (n, 1), minval=-3.0, maxval=1.0))
    return jax.random.normal(kw, (n, k), jnp.float32) * row_scale


@pytest.mark.parametrize("group_size", [None, 16, 64])
def test_quantize_int8_error_bounded(group_size):
    w = _weights(0, 48, 128)
    w_q, scale = quantize_int8(w, group_size=group_size)
    assert w_q.dtype == jnp.int8 and scale.dtype == jnp.float32
    assert scale.shape == ((48,) if group_size is None else (48, 128 // group_size))
    w_np, q_np = np.asarray(w), np.asarray(w_q, np.int32)
    assert np.abs(q_np).max() <= 127
    # Each row / group uses the full range: its largest |w| maps to +-127.
    groups = q_np.reshape(48, -1, group_size or 128)
    assert np.all(np.abs(groups).max(axis=-1) == 127)
    # Rounding error at most half a quantisation step per element.
    step = np.repeat(np.asarray(scale).reshape(48, -1), group_size or 128, axis=1)
    err = np.abs(np.asarray(dequantize_int8(w_q, scale)) - w_np)
    assert np.all(err <= 0.5 * step * (1 + 1e-6))
    assert _rel_err(dequantize_int8(w_q, scale), w) < 0.01


def test_quantize_int8_zero_rows():
    w = jnp.zeros((4, 32)).at[1].set(jnp.arange(32.0) - 16.0)
    w_q, scale = quantize_int8(w)
    assert np.all(np.isfinite(np.asarray(scale))) and np.all(np.asarray(w_q)[[0, 2, 3]] == 0)


@pytest.mark.parametrize("group_size", [None, 32])
def test_reference_matches_float64(group_size):
    x = jax.random.normal(jax.random.key(1), (7, 64), jnp.float32)
    w_q, scale = quantize_int8(_weights(2, 40, 64), group_size=group_size)
    ref = int8_matmul_reference(x, w_q, scale)
    w64 = np.asarray(w_q, np.float64).reshape(40, -1, group_size or 64)
    w64 = (w64 * np.asarray(scale, np.float64).reshape(40, -1, 1)).reshape(40, 64)
    np.testing.assert_allclose(np.asarray(ref), np.asarray(x, np.float64) @ w64.T, rtol=1e-5, atol=1e-5)


# (m, n, k, group_size, dtype, block_sizes)
CASES = {
    "decode_row_channel": (1, 128, 256, None, jnp.float32, None),
    "odd_m_channel_multistep": (5, 96, 256, None, jnp.float32, BlockSizes(16, 32, 64)),
    "odd_m_group16": (33, 64, 128, 16, jnp.float32, BlockSizes(16, 32, 64)),
    "group64_default_blocks": (8, 128, 256, 64, jnp.float32, None),
    "bf16_channel": (3, 64, 192, None, jnp.bfloat16, BlockSizes(16, 16, 64)),
    "bf16_group32": (20, 96, 128, 32, jnp.bfloat16, BlockSizes(16, 32, 64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    m, n, k, group_size, dtype, block_sizes = CASES[case]
    x = jax.random.normal(jax.random.key(3), (m, k), jnp.float32).astype(dtype)
    w = _weights(4, n, k)
    w_q, scale = quantize_int8(w, group_size=group_size)
    y = int8_matmul(x, w_q, scale, block_sizes=block_sizes, interpret=INTERPRET)
    ref = int8_matmul_reference(x, w_q, scale)
    assert y.shape == (m, n) and y.dtype == dtype
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    assert _rel_err(y, ref) < TOLERANCE[dtype]
    # End to end, the quantised product stays close to the float product.
    assert _rel_err(y, np.asarray(x, np.float64) @ np.asarray(w, np.float64).T) < 0.02


@pytest.mark.parametrize(
    "x_shape, w_shape, scale_shape, kwargs",
    [
        ((4, 64), (32, 48), (32,), {}),  # contraction mismatch
        ((4, 64), (32, 64), (16,), {}),  # scale rows mismatch
        ((4, 64), (32, 64), (32, 5), {}),  # groups do not divide k
        ((4, 64), (48, 64), (48,), {"block_sizes": BlockSizes(16, 32, 64)}),  # block_n does not divide n
    ],
)
def test_invalid_inputs_raise(x_shape, w_shape, scale_shape, kwargs):
    with pytest.raises(ValueError):
        int8_matmul(
            jnp.ones(x_shape),
            jnp.ones(w_shape, jnp.int8),
            jnp.ones(scale_shape),
            interpret=INTERPRET,
            **kwargs,
        )


def test_float_weights_rejected():
    with pytest.raises(ValueError):
        int8_matmul(jnp.ones((4, 64)), jnp.ones((32, 64)), jnp.ones((32,)), interpret=INTERPRET)


def test_quantize_kv_int8_per_token_head():
    # [slots, kv_heads, len, head_dim]: one scale per (slot, head, token).
    x = jax.random.normal(jax.random.key(5), (2, 3, 17, 64), jnp.float32) * 4.0
    x_q, scale = quantize_kv_int8(x)
    assert x_q.shape == x.shape and x_q.dtype == jnp.int8 and scale.shape == (2, 3, 17)
    err = np.abs(np.asarray(dequantize_kv_int8(x_q, scale)) - np.asarray(x))
    assert np.all(err <= 0.5 * np.asarray(scale)[..., None] * (1 + 1e-6))
    x_q2, scale2 = quantize_kv_int8(jnp.moveaxis(x, -1, 1), axis=1)
    np.testing.assert_array_equal(np.asarray(jnp.moveaxis(x_q2, 1, -1)), np.asarray(x_q))
    np.testing.assert_array_equal(np.asarray(scale2), np.asarray(scale))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("num_groups", [None, 8])
def test_lowers_for_gpu_and_tpu(platform, num_groups):
    # Pallas -> Triton / Mosaic lowering without the hardware: catches unsupported ops and block shapes.
    spec = jax.ShapeDtypeStruct
    scale = spec((512,) if num_groups is None else (512, num_groups), jnp.float32)
    exported = export_for_platform(
        int8_matmul, platform, spec((13, 1024), jnp.bfloat16), spec((512, 1024), jnp.int8), scale
    )
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in exported.mlir_module()
