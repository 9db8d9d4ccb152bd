"""4-bit mixture-of-experts weights end to end: the stacked Int4Weight format, the grouped matmul over it
(XLA and every native ISA variant this CPU runs), moe_mlp, quantize_params on a tiny MoE model, and GGUF
4-bit expert tensors repacked without a float round trip."""

from __future__ import annotations

import dataclasses
import functools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.cpu_kernels.grouped_matmul import grouped_matmul_available, grouped_matmul_cpu
from jaxinfer.evaluation import teacher_forced_logits
from jaxinfer.loading.gguf_loader import linear_weights_are_4bit, load_gguf, open_gguf
from jaxinfer.models.moe import grouped_matmul, grouped_matmul_reference, moe_mlp, moe_mlp_reference
from jaxinfer.models.params import check_params, layer_shapes, random_params, top_shapes
from jaxinfer.quantization import (
    add_bf16_copies,
    add_vnni_weights,
    map_weights,
    pack_int4_weights,
    quantization_of,
    quantize_params,
)
from jaxinfer.weight_formats import (
    Int4Weight,
    Int8Weight,
    PackedInt4Weight,
    check_int4_shape,
    int4_grid,
    is_quantized,
    quantize_int4,
)
from tests.test_moe import CPU_ISAS, MATMULS, _rel, needs_native, swiglu


def _int4(rng, shape, group_size: int = 32) -> Int4Weight:
    return quantize_int4(jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32), group_size)


def _same(a: Int4Weight, b: Int4Weight) -> None:
    assert a.group_size == b.group_size
    for field in ("packed", "scale", "minimum"):
        x, y = np.asarray(getattr(a, field)), np.asarray(getattr(b, field))
        assert x.dtype == y.dtype and x.shape == y.shape, field
        np.testing.assert_array_equal(x, y, err_msg=field)


# ---- the stacked format -----------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32, 128])
def test_stacked_int4_is_each_experts_2d_int4_bit_for_bit(group_size):
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 24, 256)), jnp.float32)
    stacked = quantize_int4(w, group_size)
    assert stacked.shape == (3, 24, 256) and stacked.packed.shape == (3, 24, 128)
    assert stacked.scale.shape == stacked.minimum.shape == (3, 24, 256 // group_size)
    assert stacked.packed.dtype == jnp.uint8 and stacked.scale.dtype == jnp.float32
    for e in range(3):
        alone = quantize_int4(w[e], group_size)
        _same(jax.tree.map(lambda a, e=e: a[e], stacked), alone)
        np.testing.assert_array_equal(np.asarray(stacked.dequantize()[e]), np.asarray(alone.dequantize()))
    # Jitted (as quantize_params runs it) the same bytes.
    _same(jax.jit(quantize_int4, static_argnames="group_size")(w, group_size=group_size), stacked)
    # values -> from_values round trip, on device and on the host (numpy stays numpy).
    _same(Int4Weight.from_values(stacked.values(), stacked.scale, stacked.minimum, group_size), stacked)
    host = Int4Weight.from_values(
        np.asarray(stacked.values()), np.asarray(stacked.scale), np.asarray(stacked.minimum), group_size
    )
    assert isinstance(host.packed, np.ndarray)
    _same(host, stacked)
    # The grid's levels and a per-expert clip broadcast the same way.
    clip = jnp.full((3, 24, 256 // group_size), 0.9)
    q, scale, low = int4_grid(w, group_size, clip)
    q1, scale1, low1 = int4_grid(w[1], group_size, clip[1])
    for a, b in ((q[1], q1), (scale[1], scale1), (low[1], low1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf16 = stacked.dequantize(jnp.bfloat16)
    assert bf16.dtype == jnp.bfloat16 and bf16.shape == (3, 24, 256)


def test_int4_shapes_stacked_or_not():
    check_int4_shape((8, 64), 32)
    check_int4_shape((4, 8, 64), 32)
    for shape, group in [((4, 8, 48), 32), ((2, 4, 8, 64), 32), ((64,), 32), ((4, 8, 64), 128)]:
        with pytest.raises(ValueError):
            check_int4_shape(shape, group)


# ---- grouped matmul ---------------------------------------------------------------------------------------

# (rows, in, out, group sizes, int4 group): empty groups, a group of one row, groups of 8+ rows, rows past
# the last group, `out` off the tiles (83), groups of 128, a decode-like pair of experts.
SHAPES = [
    (37, 96, 80, (9, 0, 17, 0, 11), 32),
    (37, 256, 83, (1, 12, 0, 0, 20), 128),  # 4 rows past the groups
    (5, 64, 48, (0, 2, 3), 32),  # row blocks of 2 and 3
    (2, 1024, 272, (1, 0, 0, 1, 0, 0, 0, 0), 32),
]


def _problem(rows, in_features, out_features, sizes, group_size, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, in_features)), jnp.float32)
    w = _int4(rng, (len(sizes), out_features, in_features), group_size)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}g{s[4]}")
@pytest.mark.parametrize("impl", ["xla", *CPU_ISAS])
def test_int4_grouped_matmul_matches_the_dequantised_reference(impl, shape):
    x, w, sizes = _problem(*shape)
    want = grouped_matmul_reference(x, w, sizes)  # float32 over the dequantised experts
    if impl == "xla":
        got = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, KernelConfig()))(x, w, sizes)
    else:
        kernel = functools.partial(grouped_matmul_cpu, isa=impl)
        got = jax.jit(lambda x, w, s: kernel(x, w.packed, w.scale, s, minimum=w.minimum))(x, w, sizes)
    assert got.shape == (shape[0], shape[2]) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-5
    past = int(sum(shape[3]))
    np.testing.assert_array_equal(np.asarray(got[past:]), 0.0)  # rows in no group


@needs_native
def test_int4_native_dispatch_bfloat16_and_unread_experts():
    x, w, sizes = _problem(*SHAPES[0])
    want = grouped_matmul_reference(x, w, sizes)
    native = KernelConfig(matmul="native")
    assert _rel(grouped_matmul(x, w, sizes, native), want) < 1e-5
    got16 = grouped_matmul(x.astype(jnp.bfloat16), w, sizes, native)
    assert got16.dtype == jnp.bfloat16 and _rel(got16, want) < 1e-2
    # Experts no row was routed to are never read: NaN scales there change nothing.
    poisoned = dataclasses.replace(w, scale=w.scale.at[jnp.array([1, 3])].set(jnp.nan))
    assert _rel(grouped_matmul(x, poisoned, sizes, native), want) < 1e-5
    # Groups the kernel cannot take are refused before it runs (here two groups of 48 inputs).
    with pytest.raises(ValueError):
        grouped_matmul_cpu(x, w.packed, w.scale[..., :2], sizes, minimum=w.minimum[..., :2])


# ---- the MoE MLP ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True], ids=["gate_up", "fused"])
@pytest.mark.parametrize("matmul", MATMULS)
def test_moe_mlp_over_int4_experts_matches_the_dense_reference(matmul, fused):
    rng = np.random.default_rng(2)
    experts, hidden, inter = 5, 64, 96
    router = jnp.asarray(rng.normal(size=(experts, hidden)), jnp.float32)
    gate, up = _int4(rng, (experts, inter, hidden)), _int4(rng, (experts, inter, hidden))
    down = _int4(rng, (experts, hidden, inter))
    if fused:  # transformers' gate_up [experts, 2 * inter, hidden]: gate rows, then up rows
        gate, up = jax.tree.map(lambda g, u: jnp.concatenate([g, u], axis=1), gate, up), None
    x = jnp.asarray(rng.normal(size=(11, hidden)), jnp.float32)
    common = dict(experts_per_token=3, normalize=True, activation=swiglu)
    run = jax.jit(lambda x, *w: moe_mlp(x, *w, **common, kernels=KernelConfig(matmul=matmul)))
    got = run(x, router, gate, up, down)
    want = moe_mlp_reference(x, router, gate, up, down, **common)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert _rel(got, want) < 1e-5
    # The reference over the dequantised float experts is the same product.
    dense = [w.dequantize() if w is not None else None for w in (gate, up, down)]
    assert _rel(moe_mlp_reference(x, router, *dense, **common), want) < 1e-6


# ---- a tiny MoE model -------------------------------------------------------------------------------------

TINY_MOE = ModelConfig(
    arch="mixtral", vocab_size=96, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4, experts_per_token=2,
    expert_intermediate_size=96,
)  # fmt: skip
TOKENS = [int(t) for t in np.random.default_rng(7).integers(0, TINY_MOE.vocab_size, size=13)]


def _trained_like_params() -> dict:
    """random_params of TINY_MOE with a residual stream shaped like a trained model's: embedding rows of
    unit RMS (random_params gives 1/8) and blocks writing updates a tenth of that (o_proj and expert_down
    scaled by 0.1). Raw random_params has every block write a unit-variance update onto a small stream, so
    each int4 rounding error (~8% of a weight per group of 32) reaches the logits nearly whole: 41% from
    float here (23% for the dense test Llama, int8 2%); with this stream int4 stays near 2%, int8 near 1%."""
    params = random_params(TINY_MOE, seed=1)
    params = map_weights(params, lambda path, name, w: w * 0.1 if name in ("o_proj", "expert_down") else w)
    params["embed"] = params["embed"] * np.sqrt(TINY_MOE.hidden_size)
    return params


def test_quantize_params_takes_experts_to_int4():
    params = quantize_params(random_params(TINY_MOE, seed=1), "int4")
    check_params(TINY_MOE, params)
    assert quantization_of(params) == "int4"
    layer = params["layers"][0]
    for name in ("expert_gate", "expert_up", "expert_down"):
        w = layer[name]
        assert isinstance(w, Int4Weight) and w.group_size == 32, name
        assert w.shape == layer_shapes(TINY_MOE)[name] and w.scale.shape == (*w.shape[:2], w.shape[2] // 32)
    assert not is_quantized(layer["router"]) and isinstance(params["embed"], Int8Weight)
    # The kernel forms leave stacked experts as they are (2-D int4 matrices pack, int8 tables gain VNNI).
    packed = add_vnni_weights(pack_int4_weights(params))
    assert isinstance(packed["layers"][0]["q_proj"], PackedInt4Weight)
    assert type(packed["layers"][0]["expert_gate"]) is Int4Weight
    assert isinstance(add_bf16_copies(params)["layers"][1]["expert_down"], Int4Weight)
    # Inputs no int4 group divides (40) fall back to int8.
    odd = dataclasses.replace(TINY_MOE, expert_intermediate_size=40)
    down = quantize_params(random_params(odd, seed=1), "int4")["layers"][0]["expert_down"]
    assert isinstance(down, Int8Weight) and down.q.shape == (4, 64, 40)


def test_int4_moe_checkpoints_round_trip(tmp_path):
    from jaxinfer.loading import load_model, save_checkpoint

    params = quantize_params(random_params(TINY_MOE, seed=2), "int4")
    save_checkpoint(tmp_path / "ckpt", TINY_MOE, params)
    loaded = load_model(tmp_path / "ckpt")
    assert isinstance(loaded.params["layers"][0]["expert_down"], Int4Weight)
    flat, tree = jax.tree.flatten(params)
    flat_loaded, tree_loaded = jax.tree.flatten(loaded.params)
    assert tree == tree_loaded
    for a, b in zip(flat, flat_loaded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("matmul", MATMULS)
def test_an_int4_moe_model_stays_close_to_float(matmul):
    want = teacher_forced_logits(_trained_like_params(), TINY_MOE, TOKENS, KernelConfig())
    params = quantize_params(_trained_like_params(), "int4")
    assert isinstance(params["layers"][1]["expert_up"], Int4Weight)
    kernels = KernelConfig(matmul=matmul)
    if matmul == "xla":  # exactly the model of the dequantised weights: what the 4 bits stand for
        dequantised = map_weights(params, lambda path, name, w: w.dequantize() if is_quantized(w) else w)
        exact = teacher_forced_logits(dequantised, TINY_MOE, TOKENS, kernels)
        assert _rel(teacher_forced_logits(params, TINY_MOE, TOKENS, kernels), exact) < 1e-5
    else:  # the forms runtime.add_kernel_forms gives an int4 model for the native kernels
        params = add_vnni_weights(pack_int4_weights(params))
    got = teacher_forced_logits(params, TINY_MOE, TOKENS, kernels)
    assert _rel(got, want) < 5e-2


# ---- GGUF -------------------------------------------------------------------------------------------------

# hidden 256: Q4_K's super-blocks of 256 fit the experts' gate and up rows; their down rows (64) take
# Q4_0 or Q4_1 blocks.
GGUF_MOE = dict(vocab=48, hidden=256, heads=4, kv_heads=2, head_dim=64, experts=4, inter=64)
_GGUF_NAMES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "attn_norm": "attn_norm", "mlp_norm": "ffn_norm", "router": "ffn_gate_inp",
    "expert_gate": "ffn_gate_exps", "expert_up": "ffn_up_exps", "expert_down": "ffn_down_exps",
}  # fmt: skip
Q = gguf.GGMLQuantizationType


def _blocks(value: np.ndarray, tensor_type: Q, rng) -> np.ndarray:
    """`value` [..., in] as rows of `tensor_type` blocks uint8 [..., row bytes]: the gguf package's own
    quantiser for Q4_0 / Q4_1; random Q4_K super-blocks (it has no Q4_K quantiser) with small float16 d
    and dmin, so that weights stay below ~1."""
    if tensor_type != Q.Q4_K:
        return gguf.quants.quantize(value, tensor_type)
    weights, size = gguf.GGML_QUANT_SIZES[tensor_type]  # 256 weights in 144 bytes
    blocks = rng.integers(0, 256, size=(*value.shape[:-1], value.shape[-1] // weights, size), dtype=np.uint8)
    scales = rng.uniform(0, 1e-3, size=(*blocks.shape[:-1], 2)).astype(np.float16)  # d, dmin
    blocks[..., :4] = scales.view(np.uint8)
    return blocks.reshape(*value.shape[:-1], -1)


def _write_moe_gguf(path, types: dict[str, Q]) -> dict[str, np.ndarray]:
    """A one-layer Mixtral ("llama" with experts) GGUF file of random weights (so llama.cpp's Q/K row
    order is moot); leaves named in `types` are stored in that block type, the rest float32. Returns each
    leaf's values as the file holds them (dequantised), in our layout."""
    d = GGUF_MOE
    config = ModelConfig(
        arch="mixtral", vocab_size=d["vocab"], hidden_size=d["hidden"], intermediate_size=d["inter"],
        num_layers=1, num_heads=d["heads"], num_kv_heads=d["kv_heads"], head_dim=d["head_dim"],
        max_position_embeddings=64, num_experts=d["experts"], experts_per_token=2,
        expert_intermediate_size=d["inter"],
    )  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(1)
    writer.add_feed_forward_length(d["inter"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_expert_count(d["experts"])
    writer.add_expert_used_count(2)
    rng = np.random.default_rng(3)
    values: dict[str, np.ndarray] = {}
    shapes = top_shapes(config) | layer_shapes(config)
    for leaf, shape in shapes.items():
        if leaf.endswith("norm"):
            value = (1 + 0.1 * rng.normal(size=shape)).astype(np.float32)
        else:
            value = (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)
        name = {"embed": "token_embd", "final_norm": "output_norm", "lm_head": "output"}.get(leaf)
        name = f"{name}.weight" if name else f"blk.0.{_GGUF_NAMES[leaf]}.weight"
        if leaf in types:
            blocks = _blocks(value, types[leaf], rng)  # [..., row bytes]
            writer.add_tensor(name, blocks, raw_dtype=types[leaf])
            value = gguf.quants.dequantize(blocks, types[leaf]).reshape(shape)
        else:
            writer.add_tensor(name, value)
        values[leaf] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


EXPERT_TYPES = {"expert_gate": Q.Q4_K, "expert_up": Q.Q4_0, "expert_down": Q.Q4_1}
ATTENTION_TYPES = dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), Q.Q4_0)


def test_gguf_4bit_experts_load_as_the_files_own_values(tmp_path):
    path = tmp_path / "moe.gguf"
    values = _write_moe_gguf(path, EXPERT_TYPES)
    reader = open_gguf(path)
    assert not linear_weights_are_4bit(reader)  # attention is float32 here
    loaded = load_gguf(reader, int4=True)
    layer = loaded.params["layers"][0]
    for leaf in EXPERT_TYPES:
        w = layer[leaf]
        assert isinstance(w, Int4Weight) and w.group_size == 32, leaf
        assert w.shape == values[leaf].shape and w.scale.shape == (*w.shape[:2], w.shape[2] // 32)
        np.testing.assert_array_equal(np.asarray(w.dequantize()), values[leaf], err_msg=leaf)
    assert not is_quantized(layer["q_proj"]) and not is_quantized(layer["router"])
    # The float load reads the same values; the model computes the same logits from either.
    floats = load_gguf(reader)
    for leaf in EXPERT_TYPES:
        np.testing.assert_array_equal(np.asarray(floats.params["layers"][0][leaf]), values[leaf])
    tokens = [1, 7, 30, 2, 47, 11, 5]
    want = teacher_forced_logits(floats.params, floats.config, tokens, KernelConfig())
    for matmul in ["xla"] + (["native"] if grouped_matmul_available() else []):
        got = teacher_forced_logits(loaded.params, loaded.config, tokens, KernelConfig(matmul=matmul))
        assert _rel(got, want) < 1e-5, matmul


def test_4bit_files_count_their_expert_tensors(tmp_path):
    _write_moe_gguf(tmp_path / "all.gguf", EXPERT_TYPES | ATTENTION_TYPES)
    _write_moe_gguf(tmp_path / "float_experts.gguf", ATTENTION_TYPES)
    assert linear_weights_are_4bit(open_gguf(tmp_path / "all.gguf"))
    assert not linear_weights_are_4bit(open_gguf(tmp_path / "float_experts.gguf"))
    params = load_gguf(tmp_path / "all.gguf", int4=True).params
    assert all(isinstance(w, Int4Weight) for name, w in params["layers"][0].items() if name.endswith("proj"))
    assert quantization_of(params) == "int4"
