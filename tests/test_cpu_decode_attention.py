"""The C++ decode-attention kernel (jaxinfer.cpu_kernels) against its JAX reference, and in the engine."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.config import CacheConfig, KernelConfig
from jaxinfer.cpu_kernels import (
    decode_attention_available,
    decode_attention_cpu,
    decode_attention_cpu_reference,
    vnni_available,
)
from jaxinfer.cpu_kernels.native_build import cpu_flags
from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.params import random_params
from tests.test_engine import CONFIGS

needs_kernel = pytest.mark.skipif(
    not decode_attention_available(), reason="needs an x86-64 CPU with AVX-512F and g++"
)


def test_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    # Guards the skips in this file and in test_int8_matmul_vnni.py: a kernel that stops compiling must
    # fail here, not turn its tests into skips.
    if shutil.which("g++") is None:
        pytest.skip("no g++ on this machine")
    assert decode_attention_available() == ("avx512f" in cpu_flags())
    assert vnni_available() == ({"avx512f", "avx512bw", "avx512_vnni"} <= cpu_flags())


def _bf16_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", ["float32", "bf16bits"])
# (cache slots, query rows, kv heads, query heads, positions, head dim, window, softcap): GQA groups of
# 1, 3, 4 and 9 (more than one pass of 8 heads), a window, a softcap, a prefix of the slots.
@pytest.mark.parametrize(
    "slots,rows,kv,heads,positions,dim,window,softcap",
    [
        (5, 5, 2, 6, 41, 32, None, None),
        (4, 3, 1, 4, 70, 256, 7, None),
        (3, 3, 3, 9, 33, 64, None, 30.0),
        (6, 2, 1, 9, 19, 16, 5, 20.0),
    ],
)
def test_kernel_matches_its_reference(cache_dtype, slots, rows, kv, heads, positions, dim, window, softcap):
    rng = np.random.default_rng(positions)
    k, v = (jnp.asarray(rng.normal(size=(2, slots, kv, positions, dim)), jnp.float32) for _ in range(2))
    if cache_dtype == "bf16bits":
        k, v = _bf16_bits(k), _bf16_bits(v)
    q = jnp.asarray(rng.normal(size=(rows, heads, dim)) * 3.0, jnp.float32)  # peaked softmaxes too
    # Every kind of row: the whole cache, empty (an inactive slot), one key, some keys.
    lengths = jnp.asarray(rng.integers(2, positions, size=rows), jnp.int32).at[0].set(positions)
    lengths = lengths.at[1].set(0) if rows > 2 else lengths.at[1].set(1)
    kwargs = dict(layer=1, scale=dim**-0.5, sliding_window=window, softcap=softcap)
    got = jax.jit(lambda *a: decode_attention_cpu(*a, **kwargs))(q, k, v, lengths)
    want = decode_attention_cpu_reference(q, k, v, lengths, **kwargs)
    assert got.shape == (rows, heads, dim)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 1e-5
    if rows > 2:
        assert not np.asarray(got[1]).any()  # an inactive slot's output is zeros


@needs_kernel
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cached_decode_through_the_kernel_equals_full_recompute(arch, cache_dtype):
    config = CONFIGS[arch]  # Gemma: sliding-window layers, a window of 7 passed by the end
    params = random_params(config, seed=3)
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, config.vocab_size, size=20)]
    expected = teacher_forced_logits(params, config, tokens, KernelConfig())
    got = teacher_forced_decode_logits(
        params, config, tokens, KernelConfig(attention="native"), rows=3, cache_dtype=cache_dtype
    )
    rel = np.linalg.norm(got - expected) / np.linalg.norm(expected)
    assert rel < (1e-5 if cache_dtype == "float32" else 1e-2), rel


@needs_kernel
def test_engine_compiles_one_decode_program_per_row_bucket_with_the_kernel():
    config = CONFIGS["llama"]
    params = random_params(config, seed=0)
    cache = CacheConfig(num_slots=4, max_len=256, dtype="bfloat16")
    native = JaxEngine(params, config, cache, kernels=KernelConfig(attention="native"))
    xla = JaxEngine(params, config, cache, kernels=KernelConfig())
    # One row stays on XLA attention (kernel_dispatch.NATIVE_ATTENTION_MIN_ROWS); 2 and 4 rows read each
    # slot up to its own length, so the attend buckets collapse to the whole cache.
    assert [native.native_decode_attention(r) for r in (1, 2, 4)] == [False, True, True]
    assert native._decode_attend_buckets(4) == (256,) and len(xla._decode_attend_buckets(4)) > 1
    assert native.decode_attend_len(4, 100) == 101
    native.warmup()
    xla.warmup()
    assert native.compile_count < xla.compile_count
    # An int8 cache is not one the kernel reads: XLA attention, with its buckets.
    int8 = JaxEngine(params, config, CacheConfig(num_slots=4, max_len=256, dtype="int8"),
                     kernels=KernelConfig(attention="native"))  # fmt: skip
    assert not int8.native_decode_attention(4)


def test_native_attention_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="one CPU device"):
        KernelConfig.for_backend("cpu", "native", single_device=False)
    with pytest.raises(ValueError, match="one CPU device"):
        KernelConfig.for_backend("gpu", "native")
    # auto never picks it there
    assert KernelConfig.for_backend("cpu", single_device=False).attention == "xla"
    assert KernelConfig.for_backend("cpu", single_device=False).matmul == "xla"
