"""The checks every model family passes, on a tiny random checkpoint that transformers writes in the test.

`check_family(model, tmp_path, gguf_arch=...)` runs them all:
  * logits equal transformers' (float32) at every position of a sequence longer than any local window;
  * decoding one token at a time through the paged cache equals a full recompute;
  * a batch of two prompts of different lengths equals each prompt alone;
  * a GGUF file written from the same weights with the `gguf` package's writer, in llama.cpp's naming and
    conventions, loads to the same logits; where transformers reads that architecture from GGUF too, its
    model from the file equals the original (so the writer follows llama.cpp, not just our reader);
  * `jaxinfer generate --model DIR` (greedy, float32) gives transformers' greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxinfer.cli import main as cli_main
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.loading import load_model
from jaxinfer.loading.hf_config import config_from_hf
from jaxinfer.loading.safetensors_loader import hf_key_path, read_safetensors, safetensors_files
from jaxinfer.models.families import family_for_hf
from jaxinfer.sharding import make_mesh
from jaxinfer.testing import jit_forward, paged_cache_config

ATOL = 1e-4
SEQ_LEN = 45
# Families whose GGUF files transformers reads itself (transformers.integrations.ggml). Not Mixtral, whose
# "llama" files it reads as a dense Llama, nor Qwen3-MoE, whose expert size and routing normalisation it
# takes from its class defaults rather than from the file and llama.cpp.
TRANSFORMERS_READS_GGUF = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
_TOP_GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}


def randomize_and_save(model: torch.nn.Module, directory: Path, vocab_tokenizer=None) -> torch.nn.Module:
    """Perturbs what random init leaves constant (norms at 1 or 0, biases at 0) so each convention is
    tested, saves the model (and a tokenizer, if given) into `directory`; returns the model in eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory)
    if vocab_tokenizer is not None:
        vocab_tokenizer.save(directory)
    return model


def full_logits(loaded, tokens: np.ndarray) -> np.ndarray:
    """[rows, t] tokens (-1: padding after a row's end) -> [rows, t, vocab] logits of one forward pass."""
    rows, t = tokens.shape
    cache_config = paged_cache_config(rows, 64)
    cache = init_cache(loaded.config, cache_config, make_mesh())
    positions = np.where(tokens >= 0, np.arange(t)[None], -1).astype(np.int32)
    logits, _ = jit_forward(
        loaded.params, loaded.config, jnp.asarray(np.maximum(tokens, 0), jnp.int32), jnp.asarray(positions),
        cache, jnp.asarray(contiguous_page_table(rows, cache_config.pages_per_seq)),
    )  # fmt: skip
    return np.asarray(logits)


def assert_logits_match(loaded, model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.numpy()
    got = full_logits(loaded, tokens)
    assert got.shape == expected.shape
    diff = np.abs(got - expected).max()
    assert diff < ATOL, f"max |ours - transformers| = {diff}"
    return got


def assert_decode_equals_recompute(loaded, tokens: np.ndarray, full: np.ndarray, prefill: int = 20) -> None:
    """Prefill `prefill` tokens, then decode the rest one at a time through the cache."""
    t = tokens.shape[1]
    cache_config = paged_cache_config(1, 64)
    cache = init_cache(loaded.config, cache_config, make_mesh())
    table = jnp.asarray(contiguous_page_table(1, cache_config.pages_per_seq))
    step = [jit_forward(loaded.params, loaded.config, jnp.asarray(tokens[:, :prefill], jnp.int32),
                    jnp.arange(prefill, dtype=jnp.int32)[None], cache, table)]  # fmt: skip
    got, cache = [np.asarray(step[0][0])], step[0][1]
    for i in range(prefill, t):
        logits, cache = jit_forward(
            loaded.params, loaded.config, jnp.asarray(tokens[:, i : i + 1], jnp.int32),
            jnp.full((1, 1), i, jnp.int32), cache, table,
        )  # fmt: skip
        got.append(np.asarray(logits))
    diff = np.abs(np.concatenate(got, axis=1) - full).max()
    assert diff < ATOL, f"cached decode differs from the full recompute by {diff}"


def assert_batched_equals_alone(loaded, tokens: np.ndarray, full: np.ndarray, short: int = 19) -> None:
    """Row 0: the first `short` tokens then padding; row 1: the whole sequence."""
    batch = np.stack([np.where(np.arange(tokens.shape[1]) < short, tokens[0], -1), tokens[0]])
    got = full_logits(loaded, batch)
    alone_short = full_logits(loaded, tokens[:, :short])
    assert np.abs(got[0, :short] - alone_short[0]).max() < 1e-5
    assert np.abs(got[1] - full[0]).max() < 1e-5


def _permute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Half-split rows -> llama.cpp's adjacent-pair rows (the inverse of gguf_loader.unpermute_rope_rows)."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(directory: Path, path: Path, arch: str) -> None:
    """Writes the checkpoint in `directory` as a float32 GGUF file named and laid out as llama.cpp's
    converter does for `arch`."""
    hf = json.loads((directory / "config.json").read_text())
    config = config_from_hf(hf)
    family = family_for_hf(hf["model_type"])
    gguf_names = {leaf: name for name, leaf in family.gguf_tensors.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(config.name)
    c = config
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_theta)
    if c.sliding_window:
        writer.add_sliding_window(c.sliding_window)
    if c.attn_logit_softcap:
        writer.add_attn_logit_softcapping(c.attn_logit_softcap)
    if c.final_logit_softcap:
        writer.add_final_logit_softcapping(c.final_logit_softcap)
    if c.num_experts:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.experts_per_token)
        writer.add_expert_feed_forward_length(c.expert_intermediate_size)
    experts: dict[tuple, dict[int, np.ndarray]] = {}
    for file in safetensors_files(directory):
        for name, value in read_safetensors(file):
            place = hf_key_path(name, config)
            if place is None:
                continue
            key_path, expert = place
            value = np.asarray(value, np.float32)
            leaf = key_path[-1]
            if isinstance(leaf, str) and leaf.endswith("norm"):
                value = value + np.float32(family.hf_norm_offset)
            if family.gguf_permutes_qk and leaf in ("q_proj", "k_proj"):
                value = _permute_rope_rows(value, c.num_heads if leaf == "q_proj" else c.num_kv_heads)
            if key_path[0] != "layers":
                writer.add_tensor(_TOP_GGUF_NAMES[leaf], value)
            elif expert is not None:
                experts.setdefault(key_path, {})[expert] = value
            else:
                writer.add_tensor(f"blk.{key_path[1]}.{gguf_names[leaf]}", value)
    for key_path, parts in experts.items():
        stacked = np.stack([parts[e] for e in range(len(parts))])
        writer.add_tensor(f"blk.{key_path[1]}.{gguf_names[key_path[-1]]}", stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_gguf_matches(directory: Path, model: torch.nn.Module, tokens: np.ndarray, full, arch: str) -> None:
    path = directory / "model.gguf"
    write_gguf(directory, path, arch)
    loaded = load_model(str(path))
    got = full_logits(loaded, tokens)
    assert np.abs(got - full).max() < ATOL
    if loaded.config.arch in TRANSFORMERS_READS_GGUF:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=path.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            expected = model(torch.tensor(tokens)).logits.numpy()
            from_file = theirs(torch.tensor(tokens)).logits.numpy()
        assert np.abs(from_file - expected).max() < ATOL, "the test's GGUF writer strays from llama.cpp's"
    path.unlink()


def assert_generate_matches(directory: Path, model: torch.nn.Module, capsys, steps: int = 12) -> None:
    """`jaxinfer generate --model DIR` greedy (float32 weights and cache) vs transformers' generate."""
    argv = [
        "generate", "--model", str(directory), "--temperature", "0", "--max-tokens", str(steps),
        "--ignore-eos", "--quantize", "none", "--kv-cache-dtype", "float32", "--output", "json",
        "--compilation-cache", "", "The quick brown fox",
    ]  # fmt: skip
    code = cli_main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    row = json.loads(out.splitlines()[0])
    with torch.no_grad():
        ids = torch.tensor([row["prompt_token_ids"]])
        expected = model.generate(
            ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert row["token_ids"] == expected[0, ids.shape[1] :].tolist()


def check_family(model: torch.nn.Module, directory: Path, capsys, *, gguf_arch: str | None) -> None:
    """Every check above on a randomized `model` saved with a real vocabulary's tokenizer into `directory`."""
    loaded = load_model(str(directory))
    tokens = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=(1, SEQ_LEN))
    full = assert_logits_match(loaded, model, tokens)
    assert_decode_equals_recompute(loaded, tokens, full)
    assert_batched_equals_alone(loaded, tokens, full)
    if gguf_arch is not None:
        assert_gguf_matches(directory, model, tokens, full, gguf_arch)
    assert_generate_matches(directory, model, capsys)
