"""build_runtime's policies: `auto` quantisation and the converted-weights cache for GGUF files."""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxinfer.runtime import RuntimeOptions, build_runtime, resolve_quantize


def test_auto_quantisation_is_int8_on_cpu_only():
    assert resolve_quantize("auto", "cpu") == "int8"
    assert resolve_quantize("auto", "gpu") == "none" and resolve_quantize("auto", "tpu") == "none"
    assert resolve_quantize("none", "cpu") == "none" and resolve_quantize("int8", "tpu") == "int8"


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
