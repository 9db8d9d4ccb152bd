"""Layers stacked into one buffer per weight (layer_stack.py) compute what the per-layer weights compute:
the native kernels read a layer of a stacked weight bit for bit as they read that layer's own weight,
and a model's forward pass over the stack equals its pass over the list."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, KernelConfig
from jaxinfer.cpu_kernels import int4_matmul_cpu, int8_matmul_vnni, pack_int4, pack_int5, pack_weight
from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.layer_stack import LayerStack, stack_layers
from jaxinfer.models.params import fuse_projections, random_params
from jaxinfer.quantization import quantize_params
from jaxinfer.runtime import add_kernel_forms
from jaxinfer.weight_formats import Int5Weight, LayerOf, PackedInt4Weight, quantize_int4
from tests.test_engine import LLAMA
from tests.test_int4 import ISAS_HERE

# Only a CPU with neither instruction set (ARM) skips; a missing compiler fails, as a kernel that stopped
# building should.
needs_native = pytest.mark.skipif(not ISAS_HERE, reason="this CPU has neither AVX2 nor AVX-512 VNNI")
NATIVE = KernelConfig(matmul="native", attention="native")


def _stack(weights):
    return jax.tree.map(lambda *a: jnp.stack(a), *weights)


@needs_native
@pytest.mark.parametrize("isa", ISAS_HERE)
@pytest.mark.parametrize("kind", ["int4", "int4_half", "int5", "int8"])
def test_native_kernels_read_a_layer_of_a_stacked_weight_as_its_own(isa, kind):
    rng = np.random.default_rng(3)
    out_features, in_features, layers = 48, 160, 3
    floats = [jnp.asarray(rng.normal(size=(out_features, in_features)), jnp.float32) for _ in range(layers)]
    x = jnp.asarray(rng.normal(size=(5, in_features)), jnp.float32)
    if kind == "int8":
        qs = [
            jnp.asarray(rng.integers(-127, 128, size=(out_features, in_features)), jnp.int8) for _ in floats
        ]
        scales = [jnp.asarray(rng.uniform(0.01, 0.1, size=out_features), jnp.float32) for _ in floats]
        packed = [pack_weight(q) for q in qs]

        def run(i, layer=None):
            w, s = (_stack(packed), _stack(scales)) if layer is not None else (packed[i], scales[i])
            return jax.jit(lambda x, w, s: int8_matmul_vnni(x, w, s, layer=layer, isa=isa))(x, w, s)
    else:
        if kind == "int5":
            weights = [
                pack_int5(Int5Weight.from_values(
                    jnp.asarray(rng.integers(0, 32, size=(out_features, in_features)), jnp.uint8),
                    jnp.asarray(rng.uniform(0.01, 0.1, size=(out_features, in_features // 32)), jnp.float32),
                    jnp.asarray(rng.normal(size=(out_features, in_features // 32)), jnp.float32), 32,
                ))
                for _ in floats
            ]  # fmt: skip
        else:
            weights = [pack_int4(quantize_int4(f, 32), half_scales=kind == "int4_half") for f in floats]

        def run(i, layer=None):
            w = _stack(weights) if layer is not None else weights[i]
            return jax.jit(lambda x, w: int4_matmul_cpu(x, w, layer=layer, isa=isa))(x, w)

    for i in range(layers):
        own = np.asarray(run(i))
        np.testing.assert_array_equal(np.asarray(run(i, layer=i)), own)
        assert i == 0 or not np.array_equal(own, np.asarray(run(0))), "the layers must differ"


@needs_native
def test_a_layer_outside_the_stack_is_an_error():
    rng = np.random.default_rng(0)
    w = _stack([pack_int4(quantize_int4(jnp.asarray(rng.normal(size=(16, 32)), jnp.float32), 32))] * 2)
    x = jnp.ones((1, 32), jnp.float32)
    with pytest.raises(Exception, match="layer"):
        np.asarray(jax.jit(lambda x, w: int4_matmul_cpu(x, w, layer=2))(x, w))
    with pytest.raises(ValueError, match="does not fit"):  # a stacked weight needs its layer named
        int4_matmul_cpu(x, w)


def _native_params(config, seed: int):
    """A tiny model in the runtime's native forms: int4 layers, one int8 (VNNI) output projection, so
    the layers mix formats as a GGUF Q4_K_M file's do."""
    params = fuse_projections(quantize_params(random_params(config, seed=seed), "int4"))
    int8 = fuse_projections(quantize_params(random_params(config, seed=seed), "int8"))
    params["layers"][1]["o_proj"] = int8["layers"][1]["o_proj"]
    return add_kernel_forms(params, NATIVE)


def test_stacking_groups_each_leaf_by_name_and_format():
    params = _native_params(LLAMA, seed=2)
    stack = stack_layers(params["layers"])
    assert isinstance(stack, LayerStack) and len(stack) == LLAMA.num_layers
    # qkv, o (int4 and int8 apart), gate_up, down and two norms.
    assert len(stack.stacks) == 7
    assert len(jax.tree.leaves(stack)) < len(jax.tree.leaves(params["layers"]))
    for layer, own in zip(stack, params["layers"]):
        assert layer.keys() == own.keys()
        for name, leaf in layer.items():
            if isinstance(leaf, LayerOf):
                assert leaf.shape == own[name].shape and type(leaf.weight) is type(own[name])
                assert leaf.nbytes == sum(a.nbytes for a in jax.tree.leaves(own[name]))
                for a, b in zip(jax.tree.leaves(leaf.weight), jax.tree.leaves(own[name])):
                    np.testing.assert_array_equal(np.asarray(a[leaf.layer]), np.asarray(b))
            else:
                np.testing.assert_array_equal(np.asarray(leaf), np.asarray(own[name]))
    # Float matrices would be copied out of a stack by every product: left as the list.
    floats = random_params(LLAMA, seed=2)["layers"]
    assert stack_layers(floats) is floats


@needs_native
def test_a_forward_pass_over_the_stack_equals_the_pass_over_the_list():
    config = dataclasses.replace(LLAMA, num_layers=3, layer_types=("full_attention",) * 3)
    params = _native_params(config, seed=4)
    stacked = {**params, "layers": stack_layers(params["layers"])}
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, size=21)]
    np.testing.assert_array_equal(
        teacher_forced_logits(stacked, config, tokens, NATIVE),
        teacher_forced_logits(params, config, tokens, NATIVE),
    )
    decoded = [
        teacher_forced_decode_logits(p, config, tokens, NATIVE, rows=2, cache_dtype="float32")
        for p in (stacked, params)
    ]
    np.testing.assert_array_equal(*decoded)


@needs_native
def test_an_engine_on_native_kernels_passes_few_weight_buffers():
    params = _native_params(LLAMA, seed=1)
    cache = CacheConfig(num_pages=9, page_size=8, max_len=32, num_slots=2, dtype="float32")
    engine = JaxEngine(params, LLAMA, cache, kernels=NATIVE)
    assert isinstance(engine.params["layers"], LayerStack)
    assert len(jax.tree.leaves(engine.params["layers"])) == len(
        jax.tree.leaves(stack_layers(params["layers"]))
    )
    assert isinstance(engine.params["layers"][0]["qkv_proj"], LayerOf)
    assert isinstance(engine.params["layers"][0]["qkv_proj"].weight, PackedInt4Weight)
