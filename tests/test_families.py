"""Every model family against transformers (tests/family_checks.py): one tiny random checkpoint each.

Each config is as small as still exercises the family's differences: local layers with a window shorter
than the sequence, grouped-query attention, and each family's norms, biases and scales.
"""

from __future__ import annotations

import pytest
import transformers

from tests.family_checks import check_family, randomize_and_save

TINY = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=256,
)  # fmt: skip


def _model(kind: str, vocab_size: int):
    torch_seed = {"llama": 1, "mistral": 2, "gemma3": 3}[kind]
    import torch

    torch.manual_seed(torch_seed)
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab_size, num_hidden_layers=2, **TINY)
        return transformers.LlamaForCausalLM(config), "llama"
    if kind == "mistral":
        config = transformers.MistralConfig(
            vocab_size=vocab_size, num_hidden_layers=2, sliding_window=7, **TINY
        )
        return transformers.MistralForCausalLM(
            config
        ), None  # llama.cpp writes Mistral as "llama", windowless
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            # llama.cpp's Gemma 3 files carry no layer pattern (every sixth layer is global) and no query
            # scale (head_dim; transformers reads 256 from them): so are the real models' configs.
            vocab_size=vocab_size, num_hidden_layers=7, sliding_window=6, query_pre_attn_scalar=256,
            **(TINY | {"head_dim": 256}),
        )  # fmt: skip
        return transformers.Gemma3ForCausalLM(config), "gemma3"
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3"])
def test_family_matches_transformers(kind, tmp_path, capsys, vocab_tokenizer):
    model, gguf_arch = _model(kind, vocab_tokenizer.vocab_size)
    model = randomize_and_save(model, tmp_path, vocab_tokenizer)
    check_family(model, tmp_path, capsys, gguf_arch=gguf_arch)
