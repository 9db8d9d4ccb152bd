"""Qwen2, Qwen3 and Phi-3 against transformers (tests/family_checks.py), and what their builders refuse.

A windowed checkpoint of these families cannot take the GGUF round trip: llama.cpp's qwen2 and qwen3 have
no sliding window, and transformers reads no Phi-3 window from a GGUF file (nor does llama.cpp run one).
So the GGUF cases take the released models' values (no window; Phi-3-mini-4k's 2047, longer than the test
sequence) and windowed cases without GGUF test the windows: Phi-3's on every layer, and Qwen's rule (from
max_window_layers on, with use_sliding_window) once, on Qwen3, as Qwen2 shares its code.
"""

from __future__ import annotations

import pytest
import transformers

from jaxinfer.loading.common import ModelLoadError
from jaxinfer.loading.hf_config import config_from_hf
from jaxinfer.models import phi3
from tests.family_checks import check_family, randomize_and_save

TINY = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256,
)  # fmt: skip
# Local layers from max_window_layers on; the window is shorter than the 45-token test sequence.
QWEN_WINDOW = dict(use_sliding_window=True, sliding_window=7, max_window_layers=1, num_hidden_layers=3)


def _model(kind: str, vocab_size: int):
    import torch

    torch.manual_seed({"qwen2": 11, "qwen3": 12, "qwen3-window": 13, "phi3": 14, "phi3-window": 15}[kind])
    if kind == "qwen2":  # the small released models: tied embeddings, no window
        config = transformers.Qwen2Config(
            vocab_size=vocab_size, num_hidden_layers=2, tie_word_embeddings=True, **TINY
        )
        return transformers.Qwen2ForCausalLM(config), "qwen2"
    if kind == "qwen3":
        # transformers reads no head_dim from a qwen3 GGUF file (its Qwen3Config default, 128, applies):
        # so is every released Qwen3's head_dim.
        config = transformers.Qwen3Config(
            vocab_size=vocab_size, num_hidden_layers=2, **(TINY | {"head_dim": 128})
        )
        return transformers.Qwen3ForCausalLM(config), "qwen3"
    if kind == "qwen3-window":  # head_dim 128 as above: the same shapes compile once
        config = transformers.Qwen3Config(vocab_size=vocab_size, **QWEN_WINDOW, **(TINY | {"head_dim": 128}))
        return transformers.Qwen3ForCausalLM(config), None
    if kind == "phi3":
        # transformers reads no sliding window from a phi3 GGUF file: Phi-3-mini-4k's (longer than the test
        # sequence) keeps its cross-check exact; phi3-window tests a short one.
        config = transformers.Phi3Config(
            vocab_size=vocab_size, num_hidden_layers=2, sliding_window=2047, pad_token_id=None, **TINY
        )
        return transformers.Phi3ForCausalLM(config), "phi3"
    if kind == "phi3-window":
        config = transformers.Phi3Config(
            vocab_size=vocab_size, num_hidden_layers=2, sliding_window=7, pad_token_id=None, **TINY
        )
        return transformers.Phi3ForCausalLM(config), None
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["qwen2", "phi3", "phi3-window", "qwen3", "qwen3-window"])
def test_family_matches_transformers(kind, tmp_path, capsys, vocab_tokenizer):
    model, gguf_arch = _model(kind, vocab_tokenizer.vocab_size)
    model = randomize_and_save(model, tmp_path, vocab_tokenizer)
    check_family(model, tmp_path, capsys, gguf_arch=gguf_arch)


BASE = dict(TINY, vocab_size=128, num_hidden_layers=6)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize(
    "keys",
    [
        {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 4},
        {"use_sliding_window": True, "sliding_window": 7},  # max_window_layers 28: no local layer
        {"use_sliding_window": False, "sliding_window": 7, "max_window_layers": 2},
        {
            "use_sliding_window": True,
            "sliding_window": 7,
            "max_window_layers": 0,
            "layer_types": ["full_attention"] * 6,
        },
    ],
)
def test_qwen_layer_types_follow_transformers(model_type, keys):
    """Files without `layer_types` (older than transformers 5) get the layers transformers computes."""
    hf = {"model_type": model_type, **BASE, **keys}
    theirs = transformers.AutoConfig.for_model(**hf)
    ours = config_from_hf(hf)
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.sliding_window == (
        theirs.sliding_window if "sliding_attention" in theirs.layer_types else None
    )


@pytest.mark.parametrize(
    "hf, message",
    [
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        ({"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0] * 8}}, "LongRoPE"),
        ({"model_type": "phi3", "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8}}, "LongRoPE"),
        ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "LongRoPE"),
        ({"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
        ({"model_type": "qwen2", "layer_types": ["sliding_attention"] * 6}, "sliding_window"),
    ],
)
def test_unsupported_configs_are_refused(hf, message):
    with pytest.raises(ModelLoadError, match=message):
        config_from_hf(BASE | hf)


def test_phi3_gguf_longrope_is_refused():
    """llama.cpp writes rope.scaling.attn_factor only beside LongRoPE's factor tensors."""
    cfg = BASE | {"model_type": "phi3", "tie_word_embeddings": False, "attention_factor": 1.19}
    cfg |= phi3.gguf_longrope(cfg)
    with pytest.raises(ModelLoadError, match="LongRoPE"):
        phi3.FAMILY.build_config(cfg)
    assert phi3.gguf_longrope(BASE) == {}
