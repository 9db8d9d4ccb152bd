"""int4_matmul (Pallas, interpret mode on CPU) against int4_matmul_reference; the reference against a
float64 numpy product over weights unpacked and dequantised with numpy; input validation; lowering.

In interpret mode Pallas starts every output buffer as NaN (tests/test_flash_attention.py checks this), so
`all finite` means every element was written, padded decode rows included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._common import export_for_platform
from pallas_kernels.int4_matmul import BlockSizes, int4_matmul, int4_matmul_reference

INTERPRET = True
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _int4_weight(seed, n, k, group_size):
    """(q int64 [n, k] in [0, 15], packed uint8 [n, k // 2], scale, minimum f32 [n, k // group_size])."""
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, (n, k))
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, (n, k // group_size)).astype(np.float32)
    minimum = (rng.normal(size=(n, k // group_size)) * 0.1).astype(np.float32)
    return q, packed, scale, minimum


def _numpy_weight(packed, scale, minimum, group_size):
    """float64 [n, k] dequantised with numpy alone: low nibble -> even column, high nibble -> odd."""
    n, half = packed.shape
    q = np.empty((n, 2 * half), np.float64)
    q[:, 0::2] = packed & 0x0F
    q[:, 1::2] = packed >> 4
    expand = lambda a: np.repeat(np.asarray(a, np.float64), group_size, axis=1)
    return q * expand(scale) + expand(minimum), q


def _x(seed, m, k, dtype):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(m, k)), jnp.float32).astype(dtype)


@pytest.mark.parametrize(
    "m, n, k, group_size", [(1, 48, 96, 32), (3, 64, 256, 128), (17, 32, 384, 32), (5, 16, 128, 128)]
)
def test_reference_matches_numpy(m, n, k, group_size):
    q, packed, scale, minimum = _int4_weight(0, n, k, group_size)
    w64, q_unpacked = _numpy_weight(packed, scale, minimum, group_size)
    np.testing.assert_array_equal(q_unpacked, q)  # the packing the tests use is the documented one
    x = _x(1, m, k, jnp.float32)
    ref = int4_matmul_reference(x, packed, scale, minimum, group_size=group_size)
    assert ref.shape == (m, n) and ref.dtype == jnp.float32
    assert _rel_err(ref, np.asarray(x, np.float64) @ w64.T) < 1e-6


# (m, n, k, group_size, dtype, block_sizes)
CASES = {
    "decode_row_g32": (1, 48, 96, 32, jnp.float32, None),
    "odd_m_g128": (3, 64, 256, 128, jnp.float32, None),
    "prefill_g32_default_blocks": (17, 128, 512, 32, jnp.float32, None),
    # Several M, N tiles and contraction steps, several groups per step.
    "tiled_g32": (17, 64, 512, 32, jnp.float32, BlockSizes(16, 32, 128)),
    "tiled_g128": (3, 96, 384, 128, jnp.float32, BlockSizes(16, 32, 128)),
    "two_groups_per_step_g128": (1, 32, 512, 128, jnp.float32, BlockSizes(16, 16, 256)),
    "bf16_decode_g32": (1, 48, 96, 32, jnp.bfloat16, None),
    "bf16_g128": (17, 64, 256, 128, jnp.bfloat16, BlockSizes(16, 32, 128)),
    "bf16_tiled_g32": (3, 64, 256, 32, jnp.bfloat16, BlockSizes(16, 32, 64)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(case):
    m, n, k, group_size, dtype, block_sizes = CASES[case]
    _, packed, scale, minimum = _int4_weight(2, n, k, group_size)
    x = _x(3, m, k, dtype)
    y = int4_matmul(
        x, packed, scale, minimum, group_size=group_size, block_sizes=block_sizes, interpret=INTERPRET
    )
    ref = int4_matmul_reference(x, packed, scale, minimum, group_size=group_size)
    assert y.shape == (m, n) and y.dtype == dtype
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    assert _rel_err(y, ref) < TOLERANCE[dtype]


def _bad_inputs(case):
    """(x, packed, scale, minimum, kwargs) for a good call (k = 64, n = 32, group 32) with one thing wrong."""
    _, packed, scale, minimum = _int4_weight(4, 32, 64, 32)
    x = _x(5, 3, 64, jnp.float32)
    kwargs = {"group_size": 32}
    if case == "packed_int8":
        packed = packed.astype(np.int8)
    elif case == "packed_float":
        packed = packed.astype(np.float32)
    elif case == "k_not_multiple_of_group":
        x, packed = _x(5, 3, 48, jnp.float32), packed[:, :24]
        scale, minimum = scale[:, :1], minimum[:, :1]
    elif case == "scale_shape":
        scale = scale[:, :1]
    elif case == "minimum_rows":
        minimum = minimum[:16]
    elif case == "scale_transposed":
        scale = scale.T
    elif case == "scale_float16":
        scale = scale.astype(np.float16)
    elif case == "packed_columns":
        packed = packed[:, :16]
    elif case == "x_int":
        x = x.astype(jnp.int32)
    elif case == "group_size_64":
        kwargs["group_size"] = 64
    elif case == "block_k_below_group":
        kwargs["block_sizes"] = BlockSizes(16, 32, 16)
    elif case == "block_n_not_dividing":
        kwargs["block_sizes"] = BlockSizes(16, 64, 32)
    return x, packed, scale, minimum, kwargs


BAD_CASES = [
    "packed_int8",
    "packed_float",
    "k_not_multiple_of_group",
    "scale_shape",
    "minimum_rows",
    "scale_transposed",
    "scale_float16",
    "packed_columns",
    "x_int",
    "group_size_64",
    "block_k_below_group",
    "block_n_not_dividing",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_invalid_inputs_raise(case):
    x, packed, scale, minimum, kwargs = _bad_inputs(case)
    with pytest.raises(ValueError):
        int4_matmul(x, packed, scale, minimum, interpret=INTERPRET, **kwargs)
    if "block_sizes" not in kwargs:  # the reference ignores block sizes
        with pytest.raises(ValueError):
            int4_matmul_reference(x, packed, scale, minimum, **kwargs)


def test_valid_inputs_of_bad_cases_pass():
    # The cases above differ from this call in the one thing named.
    x, packed, scale, minimum, kwargs = _bad_inputs("none")
    y = int4_matmul(x, packed, scale, minimum, interpret=INTERPRET, **kwargs)
    assert _rel_err(y, int4_matmul_reference(x, packed, scale, minimum, **kwargs)) < 1e-5


def test_block_sizes_must_be_powers_of_two():
    with pytest.raises(ValueError):
        BlockSizes(16, 32, 96)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("group_size", [32, 128])
def test_lowers_for_gpu_and_tpu(platform, group_size):
    # Pallas -> Triton / Mosaic lowering without the hardware: catches unsupported ops and block shapes.
    spec = jax.ShapeDtypeStruct
    n, k = 512, 1024
    groups = spec((n, k // group_size), jnp.float32)
    fn = lambda x, packed, scale, minimum: int4_matmul(x, packed, scale, minimum, group_size=group_size)
    exported = export_for_platform(
        fn, platform, spec((13, k), jnp.bfloat16), spec((n, k // 2), jnp.uint8), groups, groups
    )
    assert ("triton" if platform == "cuda" else "tpu_custom_call") in exported.mlir_module()
