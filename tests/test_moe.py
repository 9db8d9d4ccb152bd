"""Mixture-of-Experts MLP blocks (jaxinfer.models.moe) and the native grouped-matmul kernel: routing against
a plain reimplementation and transformers' Mixtral / Qwen3-MoE blocks, grouped matmuls (XLA and every
native ISA variant this CPU runs, float32 and int8) against the per-row reference, and moe_mlp against the
dense every-expert oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels.grouped_matmul import (
    KERNEL,
    grouped_matmul_available,
    grouped_matmul_cpu,
    grouped_matmul_cpu_reference,
)
from jaxinfer.cpu_kernels.native_build import cpu_supports
from jaxinfer.models.moe import (
    grouped_matmul,
    grouped_matmul_reference,
    moe_mlp,
    moe_mlp_reference,
    route,
)
from jaxinfer.weight_formats import Int8Weight

# Every variant this CPU runs (AVX-512 and AVX2 on an AVX-512 machine) that builds here, each tested in this
# process.
CPU_ISAS = [isa.name for isa in KERNEL.isas if cpu_supports(isa) and grouped_matmul_available(isa.name)]
needs_native = pytest.mark.skipif(not grouped_matmul_available(), reason="native kernel unavailable here")
MATMULS = ["xla", pytest.param("native", marks=needs_native)]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def _int8(rng, shape) -> Int8Weight:
    q = jnp.asarray(rng.integers(-127, 128, size=shape), jnp.int8)
    scale = rng.uniform(0.5, 1.5, size=shape[:2]) / 127 / np.sqrt(shape[2])
    return Int8Weight(q, jnp.asarray(scale, jnp.float32))


def _float(rng, shape) -> jax.Array:
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32)


# ---- routing ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
def test_route_matches_a_plain_reimplementation(normalize):
    logits = np.random.default_rng(0).normal(size=(13, 7)).astype(np.float32) * 3
    weights, experts = route(jnp.asarray(logits), 3, normalize)
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32 and weights.shape == (13, 3)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want_experts = np.argsort(-probs, axis=-1, kind="stable")[:, :3]
    want = np.take_along_axis(probs, want_experts, axis=-1)
    if normalize:
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6)


def _hf_block(family: str, norm_topk_prob: bool):
    """A tiny transformers sparse MoE block with random weights, and its weights in moe_mlp's layout."""
    import torch
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    dims = dict(hidden_size=32, num_experts_per_tok=2)
    if family == "mixtral":
        config = transformers.MixtralConfig(**dims, intermediate_size=48, num_local_experts=6)
        block = MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **dims, moe_intermediate_size=48, num_experts=6, norm_topk_prob=norm_topk_prob
        )
        block = Qwen3MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():  # the expert parameters start uninitialised (torch.empty)
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    block.eval()
    # transformers 5 stores the experts fused: gate_up_proj [E, 2I, H] (gate rows, then up) and
    # down_proj [E, H, I].
    gate_up = jnp.asarray(block.experts.gate_up_proj.detach().numpy())
    inter = gate_up.shape[1] // 2
    weights = dict(
        router=jnp.asarray(block.gate.weight.detach().numpy()),
        gate_up=gate_up,
        gate=gate_up[:, :inter],
        up=gate_up[:, inter:],
        down=jnp.asarray(block.experts.down_proj.detach().numpy()),
    )
    return block, weights


@pytest.mark.parametrize("matmul", MATMULS)
@pytest.mark.parametrize(("family", "norm"), [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False)])
def test_moe_mlp_matches_transformers_sparse_moe_block(family, norm, matmul):
    import torch

    block, w = _hf_block(family, norm)
    x = np.random.default_rng(1).normal(size=(2, 9, 32)).astype(np.float32)
    with torch.no_grad():
        want = block(torch.from_numpy(x)).numpy().reshape(18, 32)
    # Routing first: the same experts, the same weights.
    _, hf_weights, hf_experts = block.gate(torch.from_numpy(x.reshape(18, 32)))
    weights, experts = route(jnp.asarray(x.reshape(18, 32)) @ w["router"].T, 2, norm)
    np.testing.assert_array_equal(np.asarray(experts), hf_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), hf_weights.detach().numpy(), rtol=1e-6)

    kernels = KernelConfig(matmul=matmul)
    fused = family == "mixtral"  # one family through the fused gate_up, the other through gate and up
    gate, up = (w["gate_up"], None) if fused else (w["gate"], w["up"])
    run = jax.jit(
        lambda x, router, gate, up, down: moe_mlp(
            x, router, gate, up, down, experts_per_token=2, normalize=norm, activation=swiglu,
            kernels=kernels, weights_dtype=jnp.float32 if family == "mixtral" else x.dtype,
        )
    )  # fmt: skip
    got = run(jnp.asarray(x.reshape(18, 32)), w["router"], gate, up, w["down"])
    assert got.dtype == jnp.float32 and got.shape == (18, 32)
    assert _rel(got, want) < 1e-5


# ---- grouped matmul ---------------------------------------------------------------------------------------

# (rows, in, out, group sizes): empty groups, a group of one row, rows past the last group, `in` and `out`
# off the vector width and tile (100, 83), every row in one group.
SHAPES = [
    (37, 96, 80, (9, 0, 17, 0, 11)),
    (37, 100, 83, (1, 12, 0, 0, 20)),  # 4 rows past the groups
    (5, 64, 48, (0, 2, 3)),  # row blocks of 2 and 3
    (2, 1040, 272, (1, 0, 0, 1, 0, 0, 0, 0)),  # decode-like: one token, two experts
]


def _problem(rows, in_features, out_features, sizes, int8: bool, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, in_features)), jnp.float32)
    shape = (len(sizes), out_features, in_features)
    w = _int8(rng, shape) if int8 else _float(rng, shape)
    return x, w, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("impl", ["xla", *CPU_ISAS])
def test_grouped_matmul_matches_reference(impl, shape, int8):
    x, w, sizes = _problem(*shape, int8=int8)
    want = grouped_matmul_reference(x, w, sizes)
    if impl == "xla":
        got = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, KernelConfig()))(x, w, sizes)
    else:
        q, scale = (w.q, w.scale) if int8 else (w, None)
        got = jax.jit(functools.partial(grouped_matmul_cpu, isa=impl))(x, q, scale, sizes)
    assert got.shape == (shape[0], shape[2]) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-5
    past = int(sum(shape[3]))
    np.testing.assert_array_equal(np.asarray(got[past:]), 0.0)  # rows in no group


@needs_native
def test_native_dispatch_and_bfloat16_activations():
    x, w, sizes = _problem(*SHAPES[0], int8=True)
    want = grouped_matmul_reference(x, w, sizes)
    got = grouped_matmul(x, w, sizes, KernelConfig(matmul="native"))
    assert _rel(got, want) < 1e-5
    got16 = grouped_matmul(x.astype(jnp.bfloat16), w, sizes, KernelConfig(matmul="native"))
    assert got16.dtype == jnp.bfloat16 and _rel(got16, want) < 1e-2


@pytest.mark.parametrize("isa", CPU_ISAS or [pytest.param("none", marks=pytest.mark.skip("no AVX2"))])
def test_native_kernel_leaves_empty_groups_unread(isa):
    """An expert no row was routed to does not touch the output: NaN weights there change nothing."""
    x, w, sizes = _problem(*SHAPES[0], int8=False)
    poisoned = w.at[jnp.array([1, 3])].set(jnp.nan)
    got = grouped_matmul_cpu(x, poisoned, None, sizes, isa=isa)
    assert _rel(got, grouped_matmul_cpu_reference(x, w, None, sizes)) < 1e-5


# ---- the MoE MLP ------------------------------------------------------------------------------------------


def _moe_weights(rng, experts, hidden, inter, int8: bool):
    make = functools.partial(_int8 if int8 else _float, rng)
    router = jnp.asarray(rng.normal(size=(experts, hidden)), jnp.float32)
    up_shape, down_shape = (experts, inter, hidden), (experts, hidden, inter)
    return router, make(up_shape), make(up_shape), make(down_shape)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("matmul", MATMULS)
def test_moe_mlp_matches_the_dense_reference(matmul, int8):
    rng = np.random.default_rng(2)
    router, gate, up, down = _moe_weights(rng, experts=5, hidden=48, inter=40, int8=int8)
    x = jnp.asarray(rng.normal(size=(11, 48)), jnp.float32)
    common = dict(experts_per_token=3, normalize=False, activation=swiglu)
    run = jax.jit(lambda x, *w: moe_mlp(x, *w, **common, kernels=KernelConfig(matmul=matmul)))
    got = run(x, router, gate, up, down)
    want = moe_mlp_reference(x, router, gate, up, down, **common)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert _rel(got, want) < 1e-5
    # bfloat16 activations: the output keeps x's dtype.
    got16 = run(x.astype(jnp.bfloat16), router, gate, up, down)
    assert got16.dtype == jnp.bfloat16 and _rel(got16, want) < 3e-2


@pytest.mark.parametrize("matmul", MATMULS)
def test_a_tokens_output_does_not_depend_on_the_batch(matmul):
    rng = np.random.default_rng(3)
    router, gate, up, down = _moe_weights(rng, experts=4, hidden=32, inter=24, int8=False)
    x = jnp.asarray(rng.normal(size=(7, 32)), jnp.float32)
    run = jax.jit(
        lambda x: moe_mlp(
            x, router, gate, up, down, experts_per_token=2, normalize=True, activation=swiglu,
            kernels=KernelConfig(matmul=matmul),
        )
    )  # fmt: skip
    batched = np.asarray(run(x))
    for t in (0, 4, 6):
        np.testing.assert_allclose(np.asarray(run(x[t : t + 1]))[0], batched[t], rtol=1e-6, atol=1e-6)
