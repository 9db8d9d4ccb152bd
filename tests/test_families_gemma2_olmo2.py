"""Gemma 2 and OLMo 2 against transformers (tests/family_checks.py): one tiny random checkpoint each.

The Gemma 2 checkpoint has a query scale other than head_dim and soft-caps small enough to bite on a
tiny random model's logits (its attention scores reach ~0.1, its final logits ~0.8). Its GGUF form is
checked on a second checkpoint with what llama.cpp's and transformers' GGUF readers assume of every
file: transformers reads neither soft-cap from a gemma2 GGUF file (it takes its defaults, 50 and 30,
which barely touch these logits) and takes query_pre_attn_scalar 256 where llama.cpp takes head_dim;
so head_dim 256 and the default caps there, as in the real models.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from jaxinfer.loading import load_model
from tests.family_checks import (
    SEQ_LEN,
    assert_gguf_matches,
    assert_logits_match,
    check_family,
    randomize_and_save,
)

TINY = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256,
)  # fmt: skip


def _model(kind: str, vocab_size: int):
    import torch

    torch.manual_seed({"gemma2": 4, "gemma2-gguf": 5, "olmo2": 6}[kind])
    if kind == "gemma2":
        config = transformers.Gemma2Config(
            # Layer 0 local (a window of 6 in the 45-token sequence), layer 1 global, one RoPE base
            # other than the local default 10000 for both.
            vocab_size=vocab_size, num_hidden_layers=2, sliding_window=6, query_pre_attn_scalar=24,
            attn_logit_softcapping=0.05, final_logit_softcapping=0.5, rope_parameters={"rope_theta": 5000.0},
            **TINY,
        )  # fmt: skip
        return transformers.Gemma2ForCausalLM(config), None
    if kind == "gemma2-gguf":
        config = transformers.Gemma2Config(
            vocab_size=vocab_size, num_hidden_layers=2, sliding_window=7, query_pre_attn_scalar=256,
            **(TINY | {"head_dim": 256}),
        )  # fmt: skip
        return transformers.Gemma2ForCausalLM(config), "gemma2"
    if kind == "olmo2":
        config = transformers.Olmo2Config(vocab_size=vocab_size, num_hidden_layers=2, **TINY)
        return transformers.Olmo2ForCausalLM(config), "olmo2"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gemma2", "olmo2"])
def test_family_matches_transformers(kind, tmp_path, capsys, vocab_tokenizer):
    model, gguf_arch = _model(kind, vocab_tokenizer.vocab_size)
    model = randomize_and_save(model, tmp_path, vocab_tokenizer)
    check_family(model, tmp_path, capsys, gguf_arch=gguf_arch)


def test_gemma2_gguf_matches_transformers(tmp_path):
    """The GGUF checks alone (the rest ran on the checkpoint above): ours and transformers' readers."""
    model, gguf_arch = _model("gemma2-gguf", 512)
    model = randomize_and_save(model, tmp_path)
    tokens = np.random.default_rng(1).integers(0, 512, size=(1, SEQ_LEN))
    full = assert_logits_match(load_model(str(tmp_path)), model, tokens)
    assert_gguf_matches(tmp_path, model, tokens, full, gguf_arch)
