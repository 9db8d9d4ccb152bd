"""Sharded execution on 8 simulated CPU devices: every (data x tensor) mesh must compute what one device does.

The reference is the same program on a 1x1 mesh (itself checked against full recomputation in
test_engine.py). Tiny configs have dims that divide over tensor=4 where that matters (vocab 128, llama
4 heads / 2 KV heads), while Gemma's single KV head does not divide, so its cache heads are replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.engine import DecodeBatch
from jaxinfer.generate import generate
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.models.params import random_params
from jaxinfer.models.transformer import forward
from jaxinfer.quantization import quantize_params
from jaxinfer.request import SamplingParams
from jaxinfer.sharding import (
    DATA,
    EXPERT,
    REPLICATED,
    TENSOR,
    key_path_names,
    kv_cache_spec,
    make_mesh,
    param_placement,
    param_spec,
    parse_mesh,
    shard_params,
)
from jaxinfer.testing import IdTokenizer, paged_cache_config
from jaxinfer.weight_formats import Int4Weight

VOCAB = 128
LLAMA = ModelConfig(
    arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
GEMMA = ModelConfig(
    arch="gemma3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=1, head_dim=32, max_position_embeddings=256, rope_theta=1e6, rope_local_theta=1e4,
    sliding_window=7, layer_types=("sliding_attention", "full_attention"),
    tie_word_embeddings=True, activation="gelu_tanh", query_pre_attn_scalar=24.0, qk_norm="head",
    norms="sandwich", embed_scale=8.0,
)  # fmt: skip
MOE = ModelConfig(
    arch="mixtral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256, num_experts=8, experts_per_token=2,
    expert_intermediate_size=32,
)  # fmt: skip
CONFIGS = {"llama": LLAMA, "gemma3": GEMMA}
# data x tensor; 1x1 is the reference. Tensor parallelism alone, and four ways beside a data axis (1x4
# alone adds no rule these two miss, and each engine mesh compiles its own programs).
MESHES = ["1x2", "2x4"]
# Expert parallelism, alone and beside the other axes.
MOE_MESHES = {"e4t2": {EXPERT: 4, TENSOR: 2}, "d2e4": {DATA: 2, EXPERT: 4}}
CACHE = paged_cache_config(4, 64)


def _mesh(name: str):
    if name in MOE_MESHES:
        return make_mesh(MOE_MESHES[name])
    data, tensor = map(int, name.split("x"))  # "2x4": data 2, tensor 4
    return make_mesh({DATA: data, TENSOR: tensor})


@functools.cache
def _params(arch: str):
    return random_params(_config(arch), seed=11)


def _config(arch: str) -> ModelConfig:
    return MOE if arch == "moe" else CONFIGS[arch]


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    # 6 prompts over 4 slots (two wait for a free slot); 30 tokens is two prefill chunks of 16.
    return [list(rng.integers(0, VOCAB, size=n)) for n in (5, 30, 12, 9, 21, 3)]


# -- The rules table ---------------------------------------------------------------------------------------


def test_param_rules_split_divisible_dims_and_replicate_the_rest():
    mesh = _mesh("2x4")
    assert param_spec(("layers", 0, "q_proj"), (64, 64), mesh) == P(TENSOR, None)
    assert param_spec(("layers", 0, "o_proj"), (64, 64), mesh) == P(None, TENSOR)
    assert param_spec(("embed",), (VOCAB, 64), mesh) == P(TENSOR, None)
    assert param_spec(("embed",), (101, 64), mesh) == REPLICATED  # 101 rows do not divide over 4
    assert param_spec(("layers", 1, "attn_norm"), (64,), mesh) == REPLICATED
    # int8 weights {"q", "scale"} follow their layer's rule; a scale takes its leading entries
    assert param_spec(("layers", 0, "up_proj", "q"), (128, 64), mesh) == P(TENSOR, None)
    assert param_spec(("layers", 0, "up_proj", "scale"), (128,), mesh) == P(TENSOR)
    assert param_spec(("layers", 0, "down_proj", "scale"), (64,), mesh) == REPLICATED
    place = param_placement(mesh)
    assert place(("lm_head",), (VOCAB, 64), "float32") == NamedSharding(mesh, P(TENSOR, None))
    # Gemma's one KV head cannot split over tensor=4: its pages are replicated
    assert kv_cache_spec(1, mesh) == P(None, None, None, None, None)
    assert kv_cache_spec(2, _mesh("1x2")) == P(None, TENSOR, None, None, None)


def test_mesh_construction_validates():
    assert parse_mesh("data=2, tensor=4") == {DATA: 2, TENSOR: 4}
    mesh = make_mesh({TENSOR: 4})
    assert dict(mesh.shape) == {DATA: 1, EXPERT: 1, TENSOR: 4}
    assert list(mesh.devices.flat) == jax.devices()[:4]
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh({DATA: 4, TENSOR: 4})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        make_mesh({"pipeline": 2})
    with pytest.raises(ValueError, match="bad mesh entry"):
        parse_mesh("tensor=0")


# -- Logits of the bare forward pass ------------------------------------------------------------------------


def _two_steps(params, cache, prompt, *, config):
    """Prefill `prompt` into row 1's pages, then one decode step over every row: (prefill, decode) logits."""
    t = prompt.shape[1]
    table = jnp.asarray(contiguous_page_table(4, 4))  # 4 rows x 32 positions
    logits_p, cache = forward(params, config, prompt, jnp.arange(t, dtype=jnp.int32)[None], cache, table[1:2])
    step = jnp.array([[7], [int(VOCAB) - 1], [3], [9]], jnp.int32)
    positions = jnp.array([[-1], [t], [-1], [-1]], jnp.int32)  # only row 1 is live
    logits_d, cache = forward(params, config, step, positions, cache, table)
    return logits_p, logits_d, cache


@functools.cache
def _forward_logits(arch: str, mesh_name: str, quantize: str = "none"):
    config, mesh = _config(arch), _mesh(mesh_name)
    params = _params(arch)
    if quantize != "none":  # quantize_params consumes its input
        params = quantize_params(jax.tree.map(jnp.copy, params), quantize)
    params = shard_params(params, mesh)
    cache = init_cache(config, CACHE, mesh)
    prompt = jnp.asarray(np.random.default_rng(5).integers(0, VOCAB, size=(1, 13)), jnp.int32)
    # As in the engine, the cache's layout is pinned: left free, propagation would follow k_proj's split.
    cache_shardings = jax.tree.map(lambda a: a.sharding, cache)
    replicated = NamedSharding(mesh, REPLICATED)
    step = jax.jit(
        functools.partial(_two_steps, config=config), donate_argnums=(1,),
        out_shardings=(replicated, replicated, cache_shardings),
    )  # fmt: skip
    logits_p, logits_d, cache = step(params, cache, prompt)
    assert cache.k.sharding.spec == kv_cache_spec(config.num_kv_heads, mesh)
    return np.asarray(logits_p), np.asarray(logits_d)


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_forward_logits_match_one_device(arch, mesh_name):
    want_p, want_d = _forward_logits(arch, "1x1")
    got_p, got_d = _forward_logits(arch, mesh_name)
    np.testing.assert_allclose(got_p, want_p, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_d[1], want_d[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_int4_weights_split_over_tensor_and_match_one_device(arch):
    # Each Int4Weight array follows its layer's rule: packed values and per-group scales split alike.
    mesh = _mesh("1x4")
    sharded = shard_params(quantize_params(jax.tree.map(jnp.copy, _params(arch)), "int4"), mesh)
    down = sharded["layers"][0]["down_proj"]  # row-parallel: the input axis (and its groups) split
    assert isinstance(down, Int4Weight) and down.packed.sharding.spec == P(None, TENSOR)
    assert down.scale.sharding.spec == P(None, TENSOR)
    assert sharded["layers"][0]["q_proj"].packed.sharding.spec == P(TENSOR, None)
    want_p, want_d = _forward_logits(arch, "1x1", "int4")
    got_p, got_d = _forward_logits(arch, "1x4", "int4")
    np.testing.assert_allclose(got_p, want_p, atol=1e-4, rtol=0)
    np.testing.assert_allclose(got_d[1], want_d[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("mesh_name", list(MOE_MESHES))
def test_moe_experts_split_over_expert_axis_and_match_one_device(mesh_name):
    mesh = _mesh(mesh_name)
    layer = shard_params(_params("moe"), mesh)["layers"][0]
    assert layer["expert_gate"].sharding.spec == P(EXPERT, TENSOR, None)
    assert layer["expert_down"].sharding.spec == P(EXPERT, None, TENSOR)
    assert layer["expert_gate"].addressable_shards[0].data.shape[0] == 8 // mesh.shape[EXPERT]
    for quantize in ("none", "int8"):
        want_p, want_d = _forward_logits("moe", "1x1", quantize)
        got_p, got_d = _forward_logits("moe", mesh_name, quantize)
        np.testing.assert_allclose(got_p, want_p, atol=1e-4, rtol=0)
        np.testing.assert_allclose(got_d[1], want_d[1], atol=1e-4, rtol=0)


def test_moe_engine_greedy_tokens_match_one_device():
    assert _greedy("moe", "e4t2") == _greedy("moe", "1x1")


# -- The engine: prefill, decode and continuous batching ----------------------------------------------------


@functools.cache
def _engine(arch: str, mesh_name: str) -> JaxEngine:
    engine = JaxEngine(
        _params(arch), _config(arch), CACHE, mesh=_mesh(mesh_name), max_prefill_chunk=16,
        min_attend_bucket=64,
    )  # fmt: skip
    engine.warmup()
    return engine


@functools.cache
def _greedy(arch: str, mesh_name: str) -> tuple[tuple[int, ...], ...]:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = _prompts()
    results = generate(_engine(arch, mesh_name), IdTokenizer(VOCAB), prompts, [greedy] * len(prompts))
    return tuple(tuple(r.token_ids) for r in results)


def _assert_declared_shardings(engine: JaxEngine) -> None:
    mesh = engine.mesh
    flat, _ = jax.tree_util.tree_flatten_with_path(engine.params)
    for path, leaf in flat:
        key_path = key_path_names(path)
        assert leaf.sharding.mesh == mesh
        assert leaf.sharding.spec == param_spec(key_path, leaf.shape, mesh), key_path
    cache_spec = kv_cache_spec(engine.config.num_kv_heads, mesh)
    assert engine.state.cache.k.sharding.spec == cache_spec
    assert engine.state.cache.v.sharding.spec == cache_spec
    slots = DATA if CACHE.num_slots % mesh.shape[DATA] == 0 else None
    others = [leaf for leaf in jax.tree.leaves(engine.state) if leaf.ndim <= 2]
    assert others, "the state has per-slot leaves"
    for leaf in others:  # [slots] and [slots, n] leaves split their slot axis over data
        assert leaf.sharding.mesh == mesh
        assert tuple(leaf.sharding.spec)[:1] in ((slots,), ()) and all(
            axis is None for axis in tuple(leaf.sharding.spec)[1:]
        ), leaf.sharding.spec
        if mesh.shape[DATA] > 1:
            assert leaf.sharding.spec[0] == DATA


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_engine_greedy_tokens_match_one_device(arch, mesh_name):
    reference = _greedy(arch, "1x1")
    assert all(len(tokens) == 8 for tokens in reference)
    assert _greedy(arch, mesh_name) == reference
    engine = _engine(arch, mesh_name)
    compiles = engine.compile_count
    _assert_declared_shardings(engine)

    # The decode program keeps the sharded cache donated: the old buffer dies and the HLO aliases it.
    before = engine.state.cache.k
    idle = DecodeBatch(np.full(4, -1, np.int32), np.zeros((4, CACHE.pages_per_seq), np.int32))
    engine.decode(idle).result()
    assert before.is_deleted(), "the decode step did not consume (donate) the sharded cache"
    for key, program in engine._programs.items():
        if key[0] == "decode":
            assert "input_output_alias" in program.as_text()
    _assert_declared_shardings(engine)
    assert engine.compile_count == compiles, "serving on a mesh compiled a program after warm-up"


# -- Weights load straight into their shards -----------------------------------------------------------------


def test_smollm2_loads_a_quarter_of_its_weights_per_device_on_tensor4():
    from jaxinfer.loading import load_model

    mesh = _mesh("1x4")
    loaded = load_model("smollm2-135m-instruct", placement=param_placement(mesh))
    leaves = jax.tree.leaves(loaded.params)
    total = sum(leaf.nbytes for leaf in leaves)
    per_device = {d: 0 for d in mesh.devices.flat}
    expected_per_device = 0
    for leaf in leaves:
        # each leaf's shards are exactly what the rule asks for: nbytes / (ways it is split)
        ways = int(np.prod([mesh.shape[a] for a in leaf.sharding.spec if a is not None]))
        expected_per_device += leaf.nbytes // ways
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    assert set(per_device) == set(mesh.devices.flat)
    for device, nbytes in per_device.items():
        assert nbytes == expected_per_device, device
        # norms are replicated (a few KB), everything else is split four ways
        assert 0.25 * total <= nbytes <= 0.252 * total, (nbytes, total)
    spilled = [d for leaf in leaves for d in leaf.sharding.device_set if d not in per_device]
    assert not spilled
