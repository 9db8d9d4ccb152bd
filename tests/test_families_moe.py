"""Mixture-of-experts families against transformers (tests/family_checks.py), float and int8 experts."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.loading import load_model, save_checkpoint
from jaxinfer.quantization import quantize_params
from jaxinfer.weight_formats import Int8Weight
from tests.family_checks import check_family, full_logits, randomize_and_save

TINY = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    num_hidden_layers=2, num_experts_per_tok=2,
)  # fmt: skip


def _model(kind: str, vocab_size: int):
    torch.manual_seed(4)
    if kind == "mixtral":
        config = transformers.MixtralConfig(
            vocab_size=vocab_size, intermediate_size=32, num_local_experts=6, sliding_window=None, **TINY
        )
        return transformers.MixtralForCausalLM(config), "llama"
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
        norm_topk_prob=kind == "qwen3_moe_normalized", **TINY,
    )  # fmt: skip
    # llama.cpp always renormalises Qwen3-MoE routing, so only that variant round-trips through GGUF.
    return transformers.Qwen3MoeForCausalLM(config), "qwen3moe" if config.norm_topk_prob else None


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "qwen3_moe_normalized"])
def test_moe_family_matches_transformers(kind, tmp_path, capsys, vocab_tokenizer):
    model, gguf_arch = _model(kind, vocab_tokenizer.vocab_size)
    model = randomize_and_save(model, tmp_path, vocab_tokenizer)
    check_family(model, tmp_path, capsys, gguf_arch=gguf_arch)


def test_int8_experts_stay_close_to_float(tmp_path, vocab_tokenizer):
    model, _ = _model("mixtral", vocab_tokenizer.vocab_size)
    randomize_and_save(model, tmp_path)
    tokens = np.random.default_rng(2).integers(0, vocab_tokenizer.vocab_size, size=(1, 21))
    want = full_logits(load_model(str(tmp_path)), tokens)
    params = quantize_params(load_model(str(tmp_path)).params, "int8")
    experts = params["layers"][0]["expert_gate"]
    assert (
        isinstance(experts, Int8Weight) and experts.q.shape == (6, 32, 64) and experts.scale.shape == (6, 32)
    )
    loaded = load_model(str(tmp_path))
    got = full_logits(type(loaded)(loaded.config, params, loaded.kind, loaded.path), tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2

    # The stacked int8 experts survive an orbax checkpoint (what `jaxinfer convert` writes) bit for bit.
    save_checkpoint(tmp_path / "orbax", loaded.config, params)
    restored = load_model(str(tmp_path / "orbax"))
    assert jax.tree.structure(restored.params) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
