"""The C++ VNNI int8 matmul (jaxinfer.cpu_kernels) against its plain-JAX reference and the float product."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import (
    int8_matmul_vnni,
    int8_matmul_vnni_reference,
    pack_weight,
    supports,
    vnni_available,
)
from jaxinfer.cpu_kernels.native_build import ISAS, cpu_supports
from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.kernel_dispatch import linear, native_attention_min_rows
from jaxinfer.models.params import fuse_projections, random_params
from jaxinfer.quantization import add_vnni_weights, quantize_params
from pallas_kernels import dequantize_int8, quantize_int8
from tests.test_engine import CONFIGS

needs_vnni = pytest.mark.skipif(not vnni_available(), reason="needs an x86-64 CPU with AVX2 and g++")
# Every variant this CPU runs (AVX-512 VNNI and AVX2 on an AVX-512 machine), each tested in this process.
CPU_ISAS = [isa.name for isa in ISAS if cpu_supports(isa)]


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _problem(rows: int, out_features: int, in_features: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(out_features, in_features)), jnp.float32)
    x = rng.normal(size=(rows, in_features))
    x[:, 5] *= 30.0  # an outlier channel, as LLM activations have
    q, scale = quantize_int8(w)
    return jnp.asarray(x, jnp.float32), w, q, scale


def test_packed_weight_holds_every_byte_in_the_vpdpbusd_layout():
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, size=(48, 96)), jnp.int8)
    packed = np.asarray(pack_weight(q))  # [out/16, in/4, 16, 4]
    assert packed.shape == (3, 24, 16, 4) and packed.dtype == np.uint8
    # byte (block, k4, lane, j) is q[16 * block + lane, 4 * k4 + j] + 128
    assert packed[2, 7, 5, 3] == int(q[2 * 16 + 5, 4 * 7 + 3]) + 128
    unpacked = packed.transpose(0, 2, 1, 3).reshape(48, 96).astype(np.int16) - 128
    np.testing.assert_array_equal(unpacked, np.asarray(q))


def test_supported_shapes():
    assert supports(262144, 640) and supports(960, 576) and supports(16, 32)
    assert not supports(100, 64) and not supports(96, 48)


@needs_vnni
@pytest.mark.parametrize("isa", CPU_ISAS)
# Odd row counts (row groups of 4, every remainder and the five-row tile), odd numbers of 16-output
# blocks (the single-block tail), several activation blocks, an output wide enough to be split over the
# thread pool, and enough rows for the activations to be quantised over the pool.
@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [(1, 48, 96), (1, 4112, 224), (3, 80, 160), (5, 80, 160), (6, 16, 32), (17, 4112, 224), (150, 48, 256)],
)
def test_kernel_matches_its_reference_and_the_float_product(rows, out_features, in_features, isa):
    x, w, q, scale = _problem(rows, out_features, in_features)
    got = jax.jit(lambda *a: int8_matmul_vnni(*a, isa=isa))(x, pack_weight(q), scale)
    assert got.shape == (rows, out_features) and got.dtype == jnp.float32
    # Same integer products and the same scales: only the float summation order may differ.
    assert _rel(got, int8_matmul_vnni_reference(x, q, scale)) < 1e-6
    # Against the float weight: int8 weights and int8 activation blocks together stay within ~1%.
    assert _rel(got, x @ w.T) < 2e-2


@needs_vnni
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_extreme_values_are_exact(isa):
    # Every weight and activation at +-127: the largest pair sums (2 * 127 * 127) of AVX2's 16-bit
    # vpmaddubsw, with every sign combination, must come out exact (no saturation).
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.choice([-127, 127], size=(48, 128)), jnp.int8)
    x = jnp.asarray(rng.choice([-1.0, 1.0], size=(7, 128)), jnp.float32)
    x = x.at[0].set(1.0).at[1].set(-1.0)  # rows of one sign: all products of one sign
    scale = jnp.ones((48,), jnp.float32)
    got = int8_matmul_vnni(x, pack_weight(q), scale, isa=isa)
    want = np.asarray(x, np.float64) @ np.asarray(q, np.float64).T  # x_q = 127 x, x_scale = 1 / 127
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-4)


@needs_vnni
def test_an_unknown_isa_is_refused():
    x, _, q, scale = _problem(2, 16, 32)
    with pytest.raises(ValueError, match="unknown ISA"):
        int8_matmul_vnni(x, pack_weight(q), scale, isa="sse2")


@needs_vnni
@pytest.mark.parametrize("isa", CPU_ISAS)
def test_activation_blocks_confine_an_outlier_to_its_block(isa):
    # One outlier channel (x200) sets the scale of its row: per-row scales round the other 511 channels to
    # a few levels, blocks of 32 only the 31 sharing its block (error ~sqrt(31/511) ~ 0.25 as large).
    x, _, q, scale = _problem(5, 64, 512, seed=1)
    x = x.at[:, 5].multiply(200.0 / 30.0)
    dequantised = dequantize_int8(q, scale)
    reference = x @ dequantised.T
    ordinary = x.at[:, 5].set(0.0) @ dequantised.T  # what the other channels contribute

    def error(y):
        return float(jnp.linalg.norm(y - reference) / jnp.linalg.norm(ordinary))

    x_q, x_scale = quantize_int8(x)  # one scale per row
    per_row = (x_q * x_scale[:, None]).astype(jnp.float32) @ dequantised.T
    got = jax.jit(lambda *a: int8_matmul_vnni(*a, isa=isa))(x, pack_weight(q), scale)
    assert error(got) < 0.4 * error(per_row), (error(got), error(per_row))


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_linear_routes_every_row_count_to_the_kernel(rows):
    x, w, _, _ = _problem(rows, 96, 64)
    q = quantize_params({"layers": [], "q_proj": jnp.array(w)})["q_proj"]
    weight = add_vnni_weights({"layers": [], "q_proj": q})["q_proj"]
    assert weight.vnni.dtype == jnp.uint8 and weight.bf16 is None and weight.q is None
    got = jax.jit(lambda x, w: linear(x, w, KernelConfig(matmul="native")))(x, weight)
    # The kernel's result (int8 activations), not the weight-only product's.
    assert _rel(got, int8_matmul_vnni_reference(x, q.q, q.scale)) < 1e-6
    assert _rel(got, x @ q.dequantize().T) > 1e-6


def test_weights_the_kernel_cannot_take_get_a_bf16_copy():
    w = jnp.asarray(np.random.default_rng(0).normal(size=(40, 64)), jnp.float32)  # 40 outputs: not 16k
    weight = add_vnni_weights(quantize_params({"layers": [], "q_proj": w}))["q_proj"]
    assert weight.vnni is None and weight.bf16.dtype == jnp.bfloat16


@needs_vnni
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_decode_through_the_kernel_matches_recompute_at_any_batch(arch):
    config = dataclasses.replace(CONFIGS[arch], vocab_size=112)  # 112 outputs: the kernel takes every weight
    if config.embed_scale != 1.0:  # Gemma's sqrt(hidden), not a power of two (as 640's is not)
        config = dataclasses.replace(config, embed_scale=25.3)
    float_params = random_params(config, seed=3)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, size=20)]
    reference = teacher_forced_logits(float_params, config, tokens, KernelConfig())
    params = add_vnni_weights(quantize_params(fuse_projections(random_params(config, seed=3))))
    assert params["layers"][0]["qkv_proj"].vnni is not None and params["embed"].vnni is not None
    # Attention through the native kernel too, from one row on as the runtime picks for these weights:
    # XLA's own attention may reduce in another order at another row count.
    kernels = KernelConfig(matmul="native", attention="native")
    kernels = dataclasses.replace(
        kernels, native_attention_min_rows=native_attention_min_rows(params["layers"], kernels)
    )
    assert kernels.native_attention_min_rows == 1
    full = teacher_forced_logits(params, config, tokens, kernels)  # 20 rows through the kernel
    decoded = {
        rows: teacher_forced_decode_logits(params, config, tokens, kernels, rows=rows, cache_dtype="float32")
        for rows in (1, 2, 6)
    }
    # Each row is quantised, multiplied and attended on its own, in the same order in any row group: the
    # batch size changes nothing, bit for bit (without the kernels, 2 rows run as matrix-vector products
    # and 6 through the bf16 copies: their logits differ by up to ~0.05).
    np.testing.assert_array_equal(decoded[1], decoded[2])
    np.testing.assert_array_equal(decoded[2], decoded[6])
    # Cached decode vs one pass over the sequence: the same rows up to float rounding, which can move
    # an activation across an int8 rounding boundary.
    assert _rel(jnp.asarray(decoded[6]), jnp.asarray(full)) < 1e-2
    assert _rel(jnp.asarray(full), jnp.asarray(reference)) < 5e-2  # int8 weights and activations
