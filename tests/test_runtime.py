"""build_runtime's policies: `auto` quantisation, the converted-weights cache for GGUF files, and every
kernel and quantisation option with the backend's defaults."""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np
import pytest

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels import decode_attention_available, int4_matmul_available
from jaxinfer.evaluation import teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.loading import load_model
from jaxinfer.quantization import quantization_of
from jaxinfer.runtime import (
    RuntimeOptions,
    auto_quantize_mixed_gguf,
    build_runtime,
    default_cache_dtype,
    resolve_quantize,
)
from tests.test_int4 import ISAS_HERE


def test_auto_quantisation_is_int4_for_gguf_and_int8_otherwise_on_cpu_only():
    assert resolve_quantize("auto", "cpu") == "int8"
    assert resolve_quantize("auto", "cpu", "gguf") == ("int4" if int4_matmul_available() else "int8")
    assert resolve_quantize("auto", "gpu", "gguf") == "none"
    assert resolve_quantize("auto", "gpu") == "none" and resolve_quantize("auto", "tpu") == "none"
    assert resolve_quantize("none", "cpu") == "none" and resolve_quantize("int8", "tpu") == "int8"


def test_auto_keeps_a_mixed_gguf_file_int4_only_where_the_kernels_run_avx2(monkeypatch):
    from jaxinfer.cpu_kernels.native_build import AVX2, AVX512_VNNI, cpu_supports

    monkeypatch.delenv("JAXINFER_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("JAXINFER_CPU_ISA", "avx2")
    assert auto_quantize_mixed_gguf() == ("int4" if cpu_supports(AVX2) else "int8")
    monkeypatch.delenv("JAXINFER_CPU_ISA")
    vnni, avx2 = cpu_supports(AVX512_VNNI), cpu_supports(AVX2)
    assert auto_quantize_mixed_gguf() == ("int4" if avx2 and not vnni else "int8")
    monkeypatch.setenv("JAXINFER_NATIVE_KERNELS", "0")
    assert auto_quantize_mixed_gguf() == "int8"


# Skipped only on CPUs without AVX2: where the CPU has it, a kernel that fails to build fails the test.
@pytest.mark.skipif("avx2" not in ISAS_HERE, reason="this CPU has no AVX2 (the int4 kernel's AVX2 variant)")
def test_auto_loads_gemma3_as_its_own_4_and_5_bit_blocks_with_avx2_kernels(monkeypatch):
    # Gemma 3's Q4_K_M file: Q4_K and Q5_0 layers beside Q6_K and Q8_0 ones. With the kernels capped at
    # AVX2, auto keeps the 4- and 5-bit blocks as they are (as int8 they would be neither form).
    from jaxinfer.weight_formats import PackedInt4Weight, PackedInt5Weight

    monkeypatch.delenv("JAXINFER_NATIVE_KERNELS", raising=False)
    monkeypatch.setenv("JAXINFER_CPU_ISA", "avx2")
    options = RuntimeOptions(
        model="gemma3-270m", quantize="auto", num_slots=1, max_len=64, compilation_cache_dir=None,
        weights_cache_dir=None,
    )  # fmt: skip

    packed = (PackedInt4Weight, PackedInt5Weight)
    leaves = jax.tree.leaves(build_runtime(options).engine.params, is_leaf=lambda x: isinstance(x, packed))
    assert {type(leaf) for leaf in leaves if isinstance(leaf, packed)} == set(packed)


def test_converted_weights_cache_gives_the_same_model(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="jaxinfer.runtime")
    options = RuntimeOptions(
        quantize="int8", num_slots=1, max_len=64, compilation_cache_dir=None, weights_cache_dir=str(tmp_path)
    )
    first = build_runtime(options)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and not entries[0].name.count(".tmp-")  # one complete entry, no leftovers
    assert "saved converted weights" in caplog.text and "loaded converted weights" not in caplog.text
    caplog.clear()
    second = build_runtime(options)
    assert "loaded converted weights" in caplog.text
    assert second.model.kind == "gguf" and second.model.path == first.model.path
    assert second.config == first.config
    a, b = jax.tree.leaves(first.engine.params), jax.tree.leaves(second.engine.params)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    text = "Paris, 1889: the Eiffel tower's 330 m."
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert list(tmp_path.iterdir()) == entries

    # A damaged entry is dropped and written again from the GGUF file, not an error.
    (entries[0] / "jaxinfer_model.json").write_text("{not json")
    caplog.clear()
    third = build_runtime(options)
    assert "ignoring the damaged converted weights" in caplog.text
    assert "saved converted weights" in caplog.text
    assert third.tokenizer.encode(text) == first.tokenizer.encode(text)


ATTENTION_IMPLS = ["auto", "xla", "pallas"] + (["native"] if decode_attention_available() else [])


@pytest.mark.parametrize("quantize", ["none", "int8", "int4"])
@pytest.mark.parametrize("attention", ATTENTION_IMPLS)
def test_every_attention_impl_and_quantization_runs_with_the_default_cache(
    tiny_head_dim_64, attention, quantize
):
    """What a user may pass on the command line, with this backend's default KV cache dtype (bfloat16 on
    CPU), decodes the model: the runtime's own weights and kernels, fed a text one step at a time over
    two rows, stay close to the float model with a float32 cache."""
    directory = tiny_head_dim_64
    options = RuntimeOptions(
        model=str(directory), quantize=quantize, attention_impl=attention, num_slots=2, max_len=64,
        compilation_cache_dir=None,
    )  # fmt: skip
    runtime = build_runtime(options)
    engine = runtime.engine
    assert engine.cache_config.dtype == default_cache_dtype(None, "float32")
    assert quantization_of(engine.params) == quantize
    assert attention == "auto" or engine.kernels.attention == attention
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, runtime.config.vocab_size, size=12)]
    reference = _float_reference(str(directory), tuple(tokens))
    logits = teacher_forced_decode_logits(
        engine.params, runtime.config, tokens, engine.kernels, rows=2, cache_dtype=engine.cache_config.dtype
    )
    error = float(np.linalg.norm(logits - reference) / np.linalg.norm(reference))
    # bfloat16 keys and values cost ~1%, int8 weights ~1%, int4 weights of a random model ~10%.
    assert error < {"none": 0.03, "int8": 0.05, "int4": 0.25}[quantize], error


@functools.cache
def _float_reference(directory: str, tokens: tuple[int, ...]) -> np.ndarray:
    loaded = load_model(directory)
    return teacher_forced_logits(loaded.params, loaded.config, list(tokens), KernelConfig())
