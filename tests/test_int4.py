"""int4 weights: the format, the GGUF block repack, the native CPU kernel on every ISA this CPU runs,
checkpoints, and a model decoding through them."""

from __future__ import annotations

import dataclasses
import platform
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import (
    decode_attention_available,
    exact_in_float16,
    int4_matmul_cpu,
    int4_matmul_cpu_reference,
    pack_int4,
    unpack_int4,
)
from jaxinfer.cpu_kernels.native_build import ISAS, cpu_supports
from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.int4_calibration import calibrate_int4
from jaxinfer.kernel_dispatch import embed, linear, native_attention_min_rows
from jaxinfer.loading.gguf_loader import int4_blocks
from jaxinfer.models.params import check_params, fuse_projections, random_params
from jaxinfer.quantization import (
    map_weights,
    pack_int4_weights,
    quantization_of,
    quantize_params,
    weight_bytes,
)
from jaxinfer.runtime import add_kernel_forms
from jaxinfer.weight_formats import (
    Int4Weight,
    Int8Weight,
    PackedInt4Weight,
    is_quantized,
    quantize_int4,
)
from tests.test_engine import LLAMA

ISAS_HERE = [isa.name for isa in ISAS if cpu_supports(isa)]
NATIVE_POSSIBLE = bool(ISAS_HERE) and shutil.which("g++") is not None
# Each native kernel variant this CPU runs, as a test case; where it runs neither (ARM), one skipped case.
ISA_CASES = ISAS_HERE or [
    pytest.param(
        "none", marks=pytest.mark.skip(reason=f"{platform.machine()} has neither AVX2 nor AVX-512 VNNI")
    )
]


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _weight(rng, out_features: int, in_features: int, group_size: int) -> Int4Weight:
    return quantize_int4(jnp.asarray(rng.normal(size=(out_features, in_features)), jnp.float32), group_size)


@pytest.mark.parametrize("group_size", [32, 128])
def test_round_to_nearest_int4_stays_within_half_a_step(group_size):
    rng = np.random.default_rng(group_size)
    w = jnp.asarray(rng.normal(size=(24, 256)), jnp.float32)
    q = quantize_int4(w, group_size)
    assert q.packed.dtype == jnp.uint8 and q.packed.shape == (24, 128) and q.shape == (24, 256)
    assert q.scale.shape == (24, 256 // group_size)
    values = np.asarray(q.values())
    assert values.min() == 0 and values.max() == 15  # each group's extremes land on the end levels
    step = np.repeat(np.asarray(q.scale), group_size, axis=1)
    assert np.all(np.abs(np.asarray(q.dequantize()) - np.asarray(w)) <= step / 2 + 1e-6)
    # A clipping factor narrows the range: finer steps, saturated extremes.
    clipped = quantize_int4(w, group_size, clip=jnp.full(q.scale.shape, 0.8))
    np.testing.assert_allclose(np.asarray(clipped.scale), 0.8 * np.asarray(q.scale), rtol=1e-5)


def test_int4_rejects_shapes_it_cannot_group():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(jnp.ones((4, 48)), 32)
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(jnp.ones((4, 64)), 64)


def test_the_cpu_packing_round_trips():
    w = _weight(np.random.default_rng(0), 48, 96, 32)
    packed = pack_int4(w)
    assert isinstance(packed, PackedInt4Weight) and packed.shape == w.shape
    assert packed.packed.shape == (3, 12, 16, 4)
    back = unpack_int4(packed)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _gguf_rows(tensor_type, rows: int, cols: int, rng) -> np.ndarray:
    """Random blocks of a 4-bit type with finite float16 scales."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    data = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    halves = 2 if tensor_type == gguf.GGMLQuantizationType.Q4_0 else 4  # d (and m or dmin)
    scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block_weights, halves // 2)).astype(np.float16)
    data[..., :halves] = scales.view(np.uint8).reshape(rows, cols // block_weights, halves)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4bit_blocks_repack_to_the_files_own_values(kind):
    tensor_type = gguf.GGMLQuantizationType[kind]
    data = _gguf_rows(tensor_type, 5, 512, np.random.default_rng(1))
    q, scale, minimum = int4_blocks(data, tensor_type)
    weight = Int4Weight.from_values(q, scale, minimum, 32)
    expected = gguf.quants.dequantize(data, tensor_type)  # llama.cpp's arithmetic, as the gguf package has it
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), expected)


def test_the_embedded_smollm2_loads_its_q4_1_blocks_exactly():
    from jaxinfer.loading.gguf_loader import load_gguf, open_gguf
    from jaxinfer.registry import resolve_model

    reader = open_gguf(resolve_model("smollm2-135m-instruct")[1])
    int4 = load_gguf(reader, int4=True).params
    dense = load_gguf(reader).params
    assert quantization_of(int4) == "int4"
    for layer_int4, layer_dense in zip(int4["layers"][:3], dense["layers"][:3]):
        for name, w in layer_int4.items():
            if name.endswith("norm"):
                continue
            assert isinstance(w, Int4Weight), name  # every SmolLM2 linear weight is Q4_1
            # The repack is exact, q/k rows un-permuted like the float path.
            np.testing.assert_array_equal(np.asarray(w.dequantize()), np.asarray(layer_dense[name]))


@pytest.mark.parametrize("isa", ISA_CASES)
# Every row count that runs as one tile (1-5) and row groups with each remainder (6, 17); output blocks
# of 16 in whole tiles of four and with a tail; one row over enough weights to be split over the thread
# pool (and prefetched ahead); 150 rows: enough for the kernel to quantise the activations over the pool.
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group_size"),
    [
        (1, 48, 96, 32),
        (1, 2064, 288, 32),
        (2, 112, 160, 32),
        (3, 64, 256, 128),
        (4, 176, 128, 32),
        (5, 80, 256, 128),
        (6, 48, 96, 32),
        (17, 112, 160, 32),
        (150, 48, 256, 128),
    ],
)
def test_native_int4_kernel_matches_its_reference(isa, rows, out_features, in_features, group_size):
    rng = np.random.default_rng(rows)
    w = _weight(rng, out_features, in_features, group_size)
    x = jnp.asarray(rng.normal(size=(rows, in_features)), jnp.float32)
    got = jax.jit(lambda x, w: int4_matmul_cpu(x, w, isa=isa))(x, pack_int4(w))
    assert _rel(got, int4_matmul_cpu_reference(x, w)) < 1e-5
    # int8 activation blocks of 32 cost about 1% against the exact product of the 4-bit weight.
    assert _rel(got, x @ w.dequantize().T) < 3e-2


@pytest.mark.parametrize("isa", ISA_CASES)
def test_native_int4_kernel_gives_each_row_the_same_bits_at_any_row_count(isa):
    """A verification step's rows and a batch's streams go through other tiles than one row alone; each
    output must still be the one-row product bit for bit (speculative decoding's greedy output equals
    plain decoding's only then)."""
    rng = np.random.default_rng(7)
    w = pack_int4(_weight(rng, 368, 160, 32))  # 23 blocks of 16 outputs: whole tiles and a tail
    x = jnp.asarray(rng.normal(size=(33, 160)), jnp.float32)
    product = jax.jit(lambda x, w: int4_matmul_cpu(x, w, isa=isa))
    alone = np.concatenate([np.asarray(product(x[i : i + 1], w)) for i in range(33)])
    for rows in (*range(2, 10), 33):  # 33: AVX2 unpacks each block once for many rows
        np.testing.assert_array_equal(np.asarray(product(x[:rows], w)), alone[:rows], err_msg=f"{rows} rows")


def _q4_1_weight(rng) -> Int4Weight:
    """A [48, 160] weight from random GGUF Q4_1 blocks: scales and minimums stored as float16."""
    q, scale, minimum = int4_blocks(
        _gguf_rows(gguf.GGMLQuantizationType.Q4_1, 48, 160, rng), gguf.GGMLQuantizationType.Q4_1
    )
    return Int4Weight.from_values(jnp.asarray(q), jnp.asarray(scale), jnp.asarray(minimum), 32)


def test_float16_scales_pack_only_where_exact():
    rng = np.random.default_rng(7)
    gguf_weight = _q4_1_weight(rng)
    assert exact_in_float16(gguf_weight)
    half, full = pack_int4(gguf_weight, half_scales=True), pack_int4(gguf_weight)
    assert half.scale.dtype == half.minimum.dtype == jnp.float16 and full.scale.dtype == jnp.float32
    assert weight_bytes(half) < 0.84 * weight_bytes(full)  # 5 bits per weight against 6
    for a, b in zip(jax.tree.leaves(unpack_int4(half)), jax.tree.leaves(gguf_weight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Round-to-nearest from float: float32 scales that float16 would change stay float32.
    rounded = _weight(rng, 48, 160, 32)
    assert not exact_in_float16(rounded)
    params = pack_int4_weights({"layers": [{"down_proj": rounded, "up_proj": gguf_weight}]})
    assert params["layers"][0]["down_proj"].scale.dtype == jnp.float32
    assert params["layers"][0]["up_proj"].scale.dtype == jnp.float16


@pytest.mark.parametrize("isa", ISA_CASES)
def test_native_int4_kernel_reads_float16_scales_as_their_float32_values(isa):
    rng = np.random.default_rng(7)
    gguf_weight = _q4_1_weight(rng)
    half, full = pack_int4(gguf_weight, half_scales=True), pack_int4(gguf_weight)
    run = jax.jit(lambda x, w: int4_matmul_cpu(x, w, isa=isa))
    for rows in (1, 5, 6):
        x = jnp.asarray(rng.normal(size=(rows, 160)), jnp.float32)
        got = run(x, half)  # the same values as the float32 form, read narrower
        np.testing.assert_array_equal(np.asarray(got), np.asarray(run(x, full)))
        assert _rel(got, int4_matmul_cpu_reference(x, gguf_weight)) < 1e-5


@pytest.mark.parametrize("rows", [1, 5])
def test_every_int4_linear_form_matches_the_dequantised_weight(rows):
    rng = np.random.default_rng(rows)
    w = _weight(rng, 64, 96, 32)
    x = jnp.asarray(rng.normal(size=(2, rows, 96)), jnp.float32)
    exact = x @ w.dequantize().T
    assert _rel(linear(x, w, KernelConfig()), exact) < 1e-5  # XLA over the dequantised weight
    pallas = linear(x, w, KernelConfig(matmul="pallas", interpret=True))
    assert _rel(pallas, exact) < 1e-5
    if NATIVE_POSSIBLE:
        native = linear(x, pack_int4(w), KernelConfig(matmul="native"))
        assert native.shape == exact.shape and _rel(native, exact) < 3e-2


def test_int4_embedding_rows_are_dequantised_rows():
    table = _weight(np.random.default_rng(0), 50, 64, 32)
    tokens = jnp.array([[3, 49, 0]])
    expected = table.dequantize()[tokens]
    np.testing.assert_allclose(np.asarray(embed(table, tokens, jnp.float32)), np.asarray(expected), rtol=1e-6)


def test_int4_params_quantise_layers_and_keep_tables_int8():
    params = random_params(LLAMA, seed=0)
    before = weight_bytes(params)
    quantized = quantize_params(random_params(LLAMA, seed=0), "int4")
    check_params(LLAMA, quantized)
    assert quantization_of(quantized) == "int4"
    assert isinstance(quantized["layers"][0]["down_proj"], Int4Weight)
    assert isinstance(quantized["embed"], Int8Weight)
    fused = fuse_projections(quantized)
    assert isinstance(fused["layers"][0]["qkv_proj"], Int4Weight)
    assert fused["layers"][0]["qkv_proj"].shape == (
        LLAMA.hidden_size + 2 * 2 * LLAMA.head_dim,
        LLAMA.hidden_size,
    )
    assert weight_bytes(quantized) < before * 0.3


def test_int4_checkpoints_round_trip(tmp_path):
    from jaxinfer.loading import load_model, save_checkpoint

    params = quantize_params(random_params(LLAMA, seed=2), "int4")
    save_checkpoint(tmp_path / "ckpt", LLAMA, params)
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == LLAMA
    flat, tree = jax.tree.flatten(params)
    flat_loaded, tree_loaded = jax.tree.flatten(loaded.params)
    assert tree == tree_loaded
    for a, b in zip(flat, flat_loaded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("native", [False, True])
def test_int4_decode_matches_recompute_at_any_batch(native):
    if native and not NATIVE_POSSIBLE:
        pytest.skip("needs an x86-64 CPU with AVX2 and g++")
    config = dataclasses.replace(LLAMA, vocab_size=112)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, size=20)]
    params = fuse_projections(quantize_params(random_params(config, seed=3), "int4"))
    # The same model with every weight dequantised to float32: what the 4-bit weights stand for.
    dequantised = map_weights(params, lambda path, name, w: w.dequantize() if is_quantized(w) else w)
    reference = teacher_forced_logits(dequantised, config, tokens, KernelConfig())
    # Attention through the native kernel too where it runs: XLA's own attention may reduce in another
    # order at another row count.
    attention = "native" if native and decode_attention_available() else "xla"
    kernels = KernelConfig(matmul="native", attention=attention) if native else KernelConfig()
    if native:  # the runtime's forms (packed int4 layers, the embedding in the VNNI layout) and its
        # attention choice (the native kernel from one row on where every output projection is native)
        params = add_kernel_forms(params, kernels)
        assert isinstance(params["layers"][0]["qkv_proj"], PackedInt4Weight)
        min_rows = native_attention_min_rows(params["layers"], kernels)
        kernels = dataclasses.replace(kernels, native_attention_min_rows=min_rows)
    full = teacher_forced_logits(params, config, tokens, kernels)
    # Exact through XLA; the native kernel rounds activations to int8 blocks of 32 (~1% per product,
    # compounding over the layers: 4.1% measured on this random model).
    assert _rel(full, reference) < (6e-2 if native else 1e-5)
    decoded = {
        rows: teacher_forced_decode_logits(params, config, tokens, kernels, rows=rows, cache_dtype="float32")
        for rows in (1, 2, 5)
    }
    if attention == "native":  # each row quantised and multiplied on its own: bit for bit at any batch
        np.testing.assert_array_equal(decoded[1], decoded[2])
        np.testing.assert_array_equal(decoded[2], decoded[5])
    # Cached decode vs one pass: float rounding may move an activation across an int8 rounding boundary.
    for rows, logits in decoded.items():
        assert _rel(jnp.asarray(logits), full) < (3e-2 if native else 1e-4), rows


def test_optax_calibrated_clipping_lowers_each_layers_output_error():
    config = dataclasses.replace(LLAMA, vocab_size=112)
    params = random_params(config, seed=4)
    # Heavy-tailed weights, as trained models have: a few outliers set round-to-nearest's group ranges.
    rng = np.random.default_rng(0)
    for layer in params["layers"]:
        for name in ("gate_proj", "down_proj"):
            layer[name] = layer[name] * jnp.asarray(rng.standard_t(3, size=layer[name].shape), jnp.float32)
    tokens = [int(t) for t in rng.integers(0, config.vocab_size, size=48)]
    clips, fits = calibrate_int4(params, config, tokens, steps=30)
    assert [f.layer for f in fits] == list(range(config.num_layers))
    assert all(f.calibrated_error <= f.rtn_error for f in fits)
    assert sum(f.calibrated_error for f in fits) < 0.95 * sum(f.rtn_error for f in fits)
    assert clips, "some weights were clipped"
    for (layer, name), clip in clips.items():
        weight = params["layers"][layer][name]
        assert clip.shape == (weight.shape[0], weight.shape[1] // 32)
        assert float(clip.min()) > 0 and float(clip.max()) <= 1
    # quantize_params applies them: clipped groups get finer steps than round-to-nearest's.
    (layer, name), clip = next(iter(clips.items()))
    copy = jax.tree.map(jnp.copy, params)
    rtn = quantize_params(jax.tree.map(jnp.copy, params), "int4")["layers"][layer][name]
    calibrated = quantize_params(copy, "int4", clips=clips)["layers"][layer][name]
    np.testing.assert_allclose(np.asarray(calibrated.scale), np.asarray(rtn.scale * clip), rtol=1e-4)


def test_an_int4_models_tables_keep_only_their_packed_int8_form():
    if not NATIVE_POSSIBLE:
        pytest.skip("needs an x86-64 CPU with AVX2 and g++")
    config = dataclasses.replace(LLAMA, vocab_size=112)
    params = quantize_params(random_params(config, seed=5), "int4")
    table = params["embed"].dequantize()
    native = add_kernel_forms(fuse_projections(params), KernelConfig(matmul="native"))
    packed = native["embed"]
    assert packed.q is None and packed.vnni is not None and packed.shape == (112, config.hidden_size)
    tokens = jnp.array([[0, 5, 111], [7, 7, 64]])
    # Embedding rows come out of the packed bytes; the logits product runs through the kernel at one row.
    np.testing.assert_array_equal(np.asarray(embed(packed, tokens, jnp.float32)), np.asarray(table[tokens]))
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(table))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, config.hidden_size)), jnp.float32)
    assert _rel(linear(x, packed, KernelConfig(matmul="native")), x @ table.T) < 2e-2
    assert _rel(linear(x, packed, KernelConfig()), x @ table.T) < 1e-5  # XLA reads the unpacked bytes


def test_linear_weights_are_4bit_tells_an_all_4bit_file_from_a_mixed_one():
    from jaxinfer.loading.gguf_loader import linear_weights_are_4bit, open_gguf
    from jaxinfer.registry import resolve_model

    # SmolLM2's layers are all Q4_1; Gemma 3's Q4_K_M file mixes Q4_K with Q5_0, Q6_K and Q8_0.
    assert linear_weights_are_4bit(open_gguf(resolve_model("smollm2-135m-instruct")[1]))
    assert not linear_weights_are_4bit(open_gguf(resolve_model("gemma3-270m")[1]))
