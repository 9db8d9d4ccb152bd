"""5-bit weights: GGUF's Q5_0 / Q5_1 blocks kept as the file stores them (weight_formats.Int5Weight), the
native CPU kernel's int5 form against its reference, and how a model holds and fuses them."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import (
    int4_matmul_available,
    int4_matmul_cpu,
    int4_matmul_cpu_reference,
    pack_int5,
    unpack_int4,
)
from jaxinfer.evaluation import teacher_forced_logits
from jaxinfer.kernel_dispatch import linear
from jaxinfer.loading.gguf_loader import int5_blocks, load_gguf, open_gguf
from jaxinfer.models.params import fuse_projections
from jaxinfer.quantization import map_weights, pack_int4_weights, quantization_of, quantize_params
from jaxinfer.weight_formats import (
    Int5Weight,
    Int8Weight,
    PackedInt5Weight,
    describe,
    format_name,
    quantize_int8,
)
from tests.test_int4 import ISA_CASES
from tests.test_moe_int4 import _write_moe_gguf

Q = gguf.GGMLQuantizationType


def _rel(a, b) -> float:
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _weight(rng, out_features: int, in_features: int, minimum_steps: float = -16.0) -> Int5Weight:
    """Random 5-bit values over the full range [0, 31] with float16 scales (as Q5_0 stores them)."""
    q = rng.integers(0, 32, size=(out_features, in_features), dtype=np.uint8)
    scale = rng.uniform(0.01, 0.1, size=(out_features, in_features // 32)).astype(np.float16)
    scale = scale.astype(np.float32)
    return jax.tree.map(jnp.asarray, Int5Weight.from_values(q, scale, minimum_steps * scale, 32))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1"])
def test_gguf_5bit_blocks_repack_to_the_files_own_values(kind):
    tensor_type = Q[kind]
    values = np.random.default_rng(1).normal(size=(6, 160)).astype(np.float32)
    data = gguf.quants.quantize(values, tensor_type)
    q, scale, minimum = int5_blocks(data, tensor_type)
    assert q.max() <= 31 and len(np.unique(q)) == 32
    weight = Int5Weight.from_values(q, scale, minimum, 32)
    np.testing.assert_array_equal(np.asarray(weight.values()), q)
    np.testing.assert_array_equal(np.asarray(weight.dequantize()), gguf.quants.dequantize(data, tensor_type))


def test_the_cpu_int5_packing_round_trips():
    w = _weight(np.random.default_rng(0), 48, 96)
    packed = pack_int5(w)
    assert isinstance(packed, PackedInt5Weight) and packed.shape == w.shape
    assert packed.packed.shape == (3, 12, 16, 4) and packed.high.shape == (3, 12, 16)
    back = unpack_int4(packed)
    assert isinstance(back, Int5Weight)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("isa", ISA_CASES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 48, 96), (2, 80, 160), (5, 112, 224), (17, 32, 640), (43, 48, 160)],  # 43: unpacked once
)
def test_native_int5_kernel_matches_its_reference(isa, rows, out_features, in_features):
    rng = np.random.default_rng(rows)
    w = _weight(rng, out_features, in_features)
    x = jnp.asarray(rng.normal(size=(rows, in_features)), jnp.float32)
    for half in (False, True):
        got = jax.jit(lambda x, w: int4_matmul_cpu(x, w, isa=isa))(x, pack_int5(w, half_scales=half))
        assert _rel(got, int4_matmul_cpu_reference(x, w)) < 1e-5
    assert _rel(got, x @ w.dequantize().T) < 3e-2


@pytest.mark.parametrize("isa", ISA_CASES)
def test_native_int5_kernel_is_exact_at_the_largest_products(isa):
    """Every value 31 against activations that quantise to 127: the largest products the kernel sums
    (the AVX2 code's 16-bit pair sums would overflow if it widened them once per 32 inputs, as int4 does)."""
    q = np.full((32, 128), 31, np.uint8)
    scale = np.full((32, 4), 0.5, np.float32)
    w = jax.tree.map(jnp.asarray, Int5Weight.from_values(q, scale, np.zeros_like(scale), 32))
    x = jnp.full((3, 128), 2.0, jnp.float32)
    got = int4_matmul_cpu(x, pack_int5(w), isa=isa)
    np.testing.assert_array_equal(np.asarray(got), np.full((3, 32), 128 * 2.0 * 31 * 0.5, np.float32))


def test_every_int5_linear_form_matches_the_dequantised_weight():
    rng = np.random.default_rng(3)
    w = _weight(rng, 48, 160, minimum_steps=-7.5)
    x = jnp.asarray(rng.normal(size=(2, 160)), jnp.float32)
    want = x @ w.dequantize().T
    assert _rel(linear(x, w, KernelConfig()), want) < 1e-6  # XLA over the dequantised weight
    if int4_matmul_available():
        assert _rel(linear(x, pack_int5(w), KernelConfig(matmul="native")), want) < 3e-2


# One layer whose q and k are 5-bit, v 8-bit and o 5-bit: a Q5 file beside its wider tensors (Gemma 3's
# Q4_K_M stores half its v projections as Q8_0).
ATTENTION_TYPES = {"q_proj": Q.Q5_0, "k_proj": Q.Q5_1, "v_proj": Q.Q8_0, "o_proj": Q.Q5_0}


def test_gguf_5bit_tensors_load_as_the_files_own_values(tmp_path):
    path = tmp_path / "q5.gguf"
    _write_moe_gguf(path, ATTENTION_TYPES)
    reader = open_gguf(path)
    loaded, floats = load_gguf(reader, int4=True), load_gguf(reader)
    layer = loaded.params["layers"][0]
    for leaf in ("q_proj", "k_proj", "o_proj"):
        assert isinstance(layer[leaf], Int5Weight), leaf
        # Exact, q/k rows un-permuted as the float path does it.
        np.testing.assert_array_equal(
            np.asarray(layer[leaf].dequantize()), np.asarray(floats.params["layers"][0][leaf]), err_msg=leaf
        )
    assert format_name(layer["v_proj"]) == "float"  # Q8_0: quantize_params takes it to int8
    params = quantize_params(loaded.params, "int8")  # what the runtime does with a GGUF file's other tensors
    assert quantization_of(params) == "int4" and isinstance(params["layers"][0]["v_proj"], Int8Weight)
    assert isinstance(params["layers"][0]["q_proj"], Int5Weight)  # kept, not requantised
    # The model computes the same logits as from the file's values in float (through XLA: exactly; through
    # the native kernel: with the activations' int8 rounding).
    tokens = [1, 7, 30, 2, 47, 11, 5]
    as_float = map_weights(params, lambda path, name, w: w.dequantize() if isinstance(w, Int5Weight) else w)
    want = teacher_forced_logits(as_float, loaded.config, tokens, KernelConfig())
    assert _rel(teacher_forced_logits(params, loaded.config, tokens, KernelConfig()), want) < 1e-6
    if int4_matmul_available():
        packed = pack_int4_weights(params)
        assert isinstance(packed["layers"][0]["q_proj"], PackedInt5Weight)
        got = teacher_forced_logits(packed, loaded.config, tokens, KernelConfig(matmul="native"))
        assert _rel(got, want) < 3e-2


def test_mixed_block_formats_fuse_as_int8_and_5bit_parts_fuse_as_they_are():
    rng = np.random.default_rng(5)
    q, k = _weight(rng, 64, 96), _weight(rng, 32, 96)
    v = quantize_int8(jnp.asarray(rng.normal(size=(32, 96)), jnp.float32))
    mixed = fuse_projections({"layers": [{"q_proj": q, "k_proj": k, "v_proj": v}]})["layers"][0]
    assert set(mixed) == {"qkv_proj"} and isinstance(mixed["qkv_proj"], Int8Weight)
    # Each 5-bit part requantised per output channel on its own; the int8 part as it was.
    want = jnp.concatenate([quantize_int8(w.dequantize()).dequantize() for w in (q, k)] + [v.dequantize()])
    np.testing.assert_array_equal(np.asarray(mixed["qkv_proj"].dequantize()), np.asarray(want))
    same = fuse_projections({"layers": [{"q_proj": q, "k_proj": k, "v_proj": _weight(rng, 32, 96)}]})
    fused = same["layers"][0]["qkv_proj"]
    assert isinstance(fused, Int5Weight)
    np.testing.assert_array_equal(
        np.asarray(fused.dequantize()[:96]), np.asarray(jnp.concatenate([q.dequantize(), k.dequantize()]))
    )
    # A float part beside quantised ones stays apart.
    apart = fuse_projections({"layers": [{"q_proj": q, "k_proj": k, "v_proj": v.dequantize()}]})["layers"][0]
    assert set(apart) == {"q_proj", "k_proj", "v_proj"}


def test_int5_checkpoints_round_trip(tmp_path):
    from jaxinfer.loading import load_model, save_checkpoint

    path = tmp_path / "q5.gguf"
    _write_moe_gguf(path, ATTENTION_TYPES)
    loaded = load_gguf(path, int4=True)
    params = quantize_params(loaded.params, "int8")
    assert describe(params["layers"][0]["q_proj"]) == {"format": "int5", "group_size": 32}
    save_checkpoint(tmp_path / "ckpt", loaded.config, params)
    back = load_model(tmp_path / "ckpt")
    flat, tree = jax.tree.flatten(params)
    flat_back, tree_back = jax.tree.flatten(back.params)
    assert tree == tree_back
    for a, b in zip(flat, flat_back):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="int5"):
        describe(pack_int5(params["layers"][0]["q_proj"]))


@pytest.mark.parametrize("matmul", ["xla", "pallas"])
def test_kernels_without_a_5bit_form_get_the_weights_as_int8(matmul):
    from jaxinfer.runtime import add_kernel_forms

    rng = np.random.default_rng(9)
    w = _weight(rng, 48, 96)
    want = np.asarray(quantize_int8(w.dequantize()).dequantize())
    params = add_kernel_forms({"layers": [{"q_proj": w}]}, KernelConfig(matmul=matmul))  # consumes w
    got = params["layers"][0]["q_proj"]
    assert isinstance(got, Int8Weight)
    np.testing.assert_array_equal(np.asarray(got.dequantize()), want)
    if int4_matmul_available():
        native = add_kernel_forms(
            {"layers": [{"q_proj": _weight(rng, 48, 96)}]}, KernelConfig(matmul="native")
        )
        assert isinstance(native["layers"][0]["q_proj"], PackedInt5Weight)
