"""Model numerics against Hugging Face transformers (float32, CPU): tiny checkpoints and the real GGUFs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxinfer.generate import generate
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.loading import load_model
from jaxinfer.models.transformer import forward
from jaxinfer.request import SamplingParams
from jaxinfer.sharding import make_mesh
from jaxinfer.testing import paged_cache_config

# One compiled program: run op by op, a real model's forward compiles hundreds of small ones.
_forward = jax.jit(forward, static_argnames="config")


def _full_logits(loaded, tokens: np.ndarray, attend_len: int, last_only: bool = False) -> np.ndarray:
    """Logits of a whole-sequence forward pass (no incremental decode): [1, t, vocab] or [1, vocab]."""
    cache_config = paged_cache_config(1, attend_len)
    cache = init_cache(loaded.config, cache_config, make_mesh())
    t = tokens.shape[1]
    logits, _ = _forward(
        loaded.params, loaded.config, jnp.asarray(tokens, jnp.int32),
        jnp.arange(t, dtype=jnp.int32)[None], cache,
        jnp.asarray(contiguous_page_table(1, cache_config.pages_per_seq)),
        logits_index=jnp.array([t - 1], jnp.int32) if last_only else None,
    )  # fmt: skip
    return np.asarray(logits)


@pytest.mark.parametrize("kind", ["llama", "llama3_scaled", "gemma3"])
def test_tiny_checkpoint_logits_match_transformers(tiny_hf, kind):
    directory, reference = tiny_hf(kind)
    loaded = load_model(str(directory))
    tokens = np.random.default_rng(1).integers(0, loaded.config.vocab_size, size=(1, 45))
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)).logits.numpy()
    got = _full_logits(loaded, tokens, attend_len=64)
    assert got.shape == expected.shape
    # every position, incl. those past Gemma's tiny sliding window and past llama3's original context
    assert np.abs(got - expected).max() < 1e-4


def _reference_greedy(model, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens, last-prompt-position logits and the smallest top-1/top-2 margin along the way."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    scores = torch.stack(out.logits)[:, 0].numpy()  # [steps, vocab]
    top2 = np.sort(scores, axis=-1)[:, -2:]
    return out.sequences[0, len(prompt_ids) :].tolist(), scores[0], float((top2[:, 1] - top2[:, 0]).min())


REAL_PROMPTS = {
    "smollm2-135m-instruct": "The three primary colors are red, yellow and",
    "gemma3-270m": "The history of the printing press begins",
}


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma3-270m"])
def test_real_gguf_matches_transformers(real_runtime, real_gguf, name):
    runtime = real_runtime(name)
    tok = runtime.tokenizer
    prompts = [tok.encode(REAL_PROMPTS[name])]
    if name == "gemma3-270m":
        # Longer than the 512-token sliding window, so local and global layers see different keys.
        long_text = " ".join(
            f"Item {i}: the {w} river flows north." for i, w in enumerate(["red", "blue"] * 40)
        )
        prompts.append(tok.encode(long_text + " In summary, the rivers"))
        assert len(prompts[-1]) > 600
    reference = real_gguf(name)[3]
    steps = 32
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    ours = generate(runtime.engine, tok, prompts, [greedy] * len(prompts))
    for prompt, result in zip(prompts, ours):
        expected, first_logits, margin = _reference_greedy(reference, prompt, steps)
        assert margin > 1e-3, f"pick another prompt: top-2 margin {margin} is too small to compare tokens"
        assert result.token_ids == expected
        got = _full_logits(runtime.model, np.array([prompt]), attend_len=1024, last_only=True)[0]
        assert np.abs(got - first_logits).max() < 1e-2


def test_rms_norm_of_a_row_does_not_depend_on_the_rows_beside_it():
    # A token's hidden state must not change with how many tokens its step runs (prefill chunks and
    # verification steps against one-row decode steps): bit for bit, odd widths included.
    from jaxinfer.models.transformer import rms_norm

    for dim in (576, 640, 37):
        x = jax.random.normal(jax.random.key(dim), (9, dim)) * 3.0
        w = jax.random.uniform(jax.random.key(1), (dim,)) + 0.5
        norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-6))
        together = np.asarray(norm(x, w))
        for i in range(9):
            assert np.array_equal(np.asarray(norm(x[i : i + 1], w))[0], together[i]), (dim, i)
        want = np.asarray(x) / np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, -1, keepdims=True) + 1e-6)
        assert np.abs(together - want * np.asarray(w)).max() < 1e-5 * np.abs(want).max()
