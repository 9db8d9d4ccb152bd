"""The JAX engine on tiny random models: cache decode vs full recompute, batching, donation, no recompiles."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import jit_mappings
from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.engine import FINISH_LENGTH, FINISH_STOP, DecodeBatch, PrefillChunk
from jaxinfer.generate import generate
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.kv_cache import contiguous_page_table, init_cache
from jaxinfer.models.params import random_params
from jaxinfer.models.transformer import XLA_KERNELS, forward
from jaxinfer.request import SamplingParams
from jaxinfer.sharding import make_mesh
from jaxinfer.testing import IdTokenizer, jit_forward, paged_cache_config, scattered_page_table

LLAMA = ModelConfig(
    arch="llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
GEMMA = ModelConfig(
    arch="gemma3", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
    num_kv_heads=1, head_dim=32, max_position_embeddings=256, rope_theta=1e6, rope_local_theta=1e4,
    sliding_window=7, layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    tie_word_embeddings=True, activation="gelu_tanh", query_pre_attn_scalar=24.0, qk_norm="head",
    norms="sandwich", embed_scale=8.0,
)  # fmt: skip
CONFIGS = {"llama": LLAMA, "gemma3": GEMMA}


def _full_logits(params, config, tokens: list[int], kernels: KernelConfig = XLA_KERNELS) -> np.ndarray:
    """[t, vocab] logits of one uncached pass over the whole sequence (padded to 128: one compile)."""
    cache = init_cache(config, paged_cache_config(1, 128), make_mesh())
    t = len(tokens)
    padded = jnp.zeros((1, 128), jnp.int32).at[0, :t].set(jnp.asarray(tokens, jnp.int32))
    logits, _ = jit_forward(
        params, config, padded, jnp.arange(128, dtype=jnp.int32)[None], cache,
        jnp.asarray(contiguous_page_table(1, 16)), kernels=kernels,
    )  # fmt: skip
    return np.asarray(logits[0, :t])  # causal: the padding after t changes nothing before it


@pytest.mark.parametrize("page_size,dtype", [(8, "float32"), (5, "float32"), (8, "int8"), (16, "bfloat16")])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cached_decode_equals_full_recompute(arch, page_size, dtype):
    config = CONFIGS[arch]
    params = random_params(config, seed=3)
    tokens = list(np.random.default_rng(0).integers(0, config.vocab_size, size=24))
    expected = _full_logits(params, config, tokens)
    # 6 slots: more decode rows than kernel_dispatch.ROWS_AS_VECTORS, so a bfloat16 cache is multiplied
    # in bfloat16 (attention_xla).
    slots = 6
    cache_config = paged_cache_config(slots, 64, page_size=page_size, dtype=dtype)
    cache = init_cache(config, cache_config, make_mesh())
    # Every row reads its pages through a shuffled page table; the decoding row is the last one.
    pages = cache_config.pages_per_seq
    table = jnp.asarray(scattered_page_table(slots, pages, cache_config.num_pages, seed=1))
    if dtype == "bfloat16":
        assert cache.k.dtype == jnp.uint16  # bit patterns on CPU (kv_cache.py)

    def check(got, want):
        if dtype == "float32":
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        elif dtype == "bfloat16":  # K/V and the decode query rounded to 8 mantissa bits
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
        else:  # int8 rounds each K/V entry to 1/254 of its (token, head) range
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2

    prompt = 9  # past Gemma's window of 7 by the end
    logits, cache = jit_forward(
        params, config, jnp.asarray([tokens[:prompt]], jnp.int32), jnp.arange(prompt, dtype=jnp.int32)[None],
        cache, table[-1:],
    )  # fmt: skip
    check(np.asarray(logits[0]), expected[:prompt])
    for t in range(prompt, len(tokens)):
        # the last row decodes; the others hold no request (position -1: their writes go to the null page)
        step_tokens = jnp.asarray([[5]] * (slots - 1) + [[tokens[t]]], jnp.int32)
        positions = jnp.asarray([[-1]] * (slots - 1) + [[t]], jnp.int32)
        logits, cache = jit_forward(params, config, step_tokens, positions, cache, table)
        check(np.asarray(logits[-1, 0]), expected[t])


def test_bfloat16_cache_is_written_in_place():
    """XLA:CPU would convert a whole bfloat16 cache to float32 and back around each scatter (~1 s per
    SmolLM2 step); the bit-pattern storage keeps every cache-sized array out of the program."""
    config = LLAMA
    params = random_params(config, seed=3)
    cache = init_cache(config, paged_cache_config(6, 64, dtype="bfloat16"), make_mesh())
    step = jax.jit(
        lambda params, tokens, positions, cache, table: forward(
            params, config, tokens, positions, cache, table
        ),
        donate_argnums=(3,),
    )
    tokens, positions = jnp.ones((6, 1), jnp.int32), jnp.full((6, 1), 3, jnp.int32)
    table = jnp.asarray(contiguous_page_table(6, 4))
    text = step.lower(params, tokens, positions, cache, table).compile().as_text()
    whole = ",".join(map(str, cache.k.shape))
    assert f"u16[{whole}]" in text
    assert f"f32[{whole}]" not in text and f"bf16[{whole}]" not in text


def _greedy_reference(params, config, prompt: list[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(_full_logits(params, config, tokens)[-1])))
    return tokens[len(prompt) :]


# 4 slots of up to 128 positions over 33 usable pages of 8 (264 positions): room for any one request,
# not for four long ones (test_prefix_caching_and_preemption_change_no_greedy_token preempts).
LLAMA_CACHE = CacheConfig(num_pages=34, page_size=8, max_len=128, num_slots=4, dtype="float32")


@pytest.fixture(scope="module")
def llama_engine():
    params = random_params(LLAMA, seed=1)
    engine = JaxEngine(params, LLAMA, LLAMA_CACHE, max_prefill_chunk=32)
    engine.warmup()
    return engine, params


def _prompts():
    rng = np.random.default_rng(7)
    return [list(rng.integers(0, 101, size=n)) for n in (5, 45, 17, 30, 2)]  # 45: two prefill chunks


def test_batched_greedy_equals_each_prompt_alone_and_full_recompute(llama_engine):
    engine, params = llama_engine
    tok = IdTokenizer(LLAMA.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = _prompts()  # 5 prompts over 4 slots: the last one waits for a free slot
    batched = generate(engine, tok, prompts, [greedy] * len(prompts))
    compiles = engine.compile_count
    for prompt, result in zip(prompts, batched):
        alone = generate(engine, tok, [prompt], [greedy])[0]
        assert result.token_ids == alone.token_ids
        assert result.finish_reason == "length" and len(result.token_ids) == 12
    assert engine.compile_count == compiles, "a new prompt length inside the buckets recompiled"
    for prompt, result in zip(prompts[:2], batched[:2]):
        assert result.token_ids == _greedy_reference(params, LLAMA, prompt, 12)


def test_many_rows_decode_attends_over_midpoint_buckets():
    """Decode of more than ROWS_AS_VECTORS rows reads 96 positions (12 pages) where fewer rows read 128,
    with the tokens those prompts get at 2 rows and from a full recompute."""
    params = random_params(LLAMA, seed=1)
    engine = JaxEngine(params, LLAMA, paged_cache_config(8, 128), max_prefill_chunk=32)
    tok = IdTokenizer(LLAMA.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    rng = np.random.default_rng(11)
    prompts = [list(rng.integers(0, 101, size=n)) for n in (70, 66, 75, 68, 72, 80, 71, 69)]
    batched = generate(engine, tok, prompts, [greedy] * len(prompts))
    decode_keys = {key for key in engine._programs if key[0] == "decode"}
    assert ("decode", 12, 8) in decode_keys and ("decode", 16, 8) not in decode_keys
    alone = generate(engine, tok, prompts[:2], [greedy] * 2)  # 2 rows: power-of-two buckets only
    assert ("decode", 16, 2) in engine._programs and ("decode", 12, 2) not in engine._programs
    for result, single in zip(batched, alone):
        assert result.token_ids == single.token_ids
    assert batched[0].token_ids == _greedy_reference(params, LLAMA, prompts[0], 10)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_pallas_attention_path_gives_the_xla_tokens(arch):
    config = dataclasses.replace(CONFIGS[arch], head_dim=64)  # the kernels take head dims 64/128/256
    params = random_params(config, seed=2)
    prompts = _prompts()[:3]  # incl. a chunked prompt (offsets > 0 in the flash kernel)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for impl in ("xla", "pallas"):
        kernels = KernelConfig(attention=impl, interpret=True)
        cache = paged_cache_config(3, 128, page_size=16)
        engine = JaxEngine(params, config, cache, max_prefill_chunk=32, kernels=kernels)
        results = generate(engine, IdTokenizer(config.vocab_size), prompts, [greedy] * 3)
        tokens[impl] = [r.token_ids for r in results]
    assert tokens["pallas"] == tokens["xla"]


def test_seeded_sampling_is_reproducible_and_independent_of_batching(llama_engine):
    engine, _ = llama_engine
    tok = IdTokenizer(LLAMA.vocab_size)
    s = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    prompts = _prompts()[:3]
    alone = generate(engine, tok, [prompts[0]], [s])[0].token_ids
    others = [dataclasses.replace(s, seed=99), dataclasses.replace(s, temperature=0.0)]
    batched = generate(engine, tok, prompts, [s, *others])[0].token_ids
    assert alone == batched
    reseeded = generate(engine, tok, [prompts[0]], [dataclasses.replace(s, seed=4321)])[0].token_ids
    assert reseeded != alone  # 10 draws from a near-uniform random model: equal only by a fluke


def test_stop_token_ids_and_max_tokens_on_device(llama_engine):
    engine, _ = llama_engine
    tok = IdTokenizer(LLAMA.vocab_size)
    prompt = _prompts()[1]
    free = generate(engine, tok, [prompt], [SamplingParams(temperature=0.0, max_tokens=12)])[0]
    stop_id = free.token_ids[4]
    first_hit = free.token_ids.index(stop_id)
    stopped = generate(
        engine, tok, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_id,))]
    )[0]
    assert stopped.token_ids == free.token_ids[: first_hit + 1]
    assert stopped.finish_reason == "stop"
    # stop strings are matched on the host, on the detokenised text
    text_stop = f"<{free.token_ids[6]}>"
    by_text = generate(
        engine, tok, [prompt], [SamplingParams(temperature=0.0, max_tokens=12, stop=(text_stop,))]
    )[0]
    assert by_text.finish_reason == "stop" and text_stop not in by_text.text
    assert free.text.startswith(by_text.text)


def test_prefill_reports_done_and_context_end(llama_engine):
    engine, _ = llama_engine
    s = SamplingParams(temperature=0.0, max_tokens=1)
    out = engine.prefill([PrefillChunk(1, [3, 4, 5], 0, s, page_ids=[7])]).result()
    assert out.valid[1] and out.done[1] and out.reason[1] == FINISH_LENGTH
    assert not out.valid[[0, 2, 3]].any()
    # a stop id sampled as the first token ends the request at once
    first = int(out.token[1])
    s = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(first,))
    out = engine.prefill([PrefillChunk(1, [3, 4, 5], 0, s, page_ids=[7])]).result()
    assert out.done[1] and out.reason[1] == FINISH_STOP
    assert not engine.decode(_batch(engine, {1: (3, [7])})).result().valid.any()


def _batch(engine, rows: dict[int, tuple[int, list[int]]]) -> DecodeBatch:
    """A decode batch listing {slot: (position, pages)}."""
    positions = np.full(engine.num_slots, -1, np.int32)
    table = np.zeros((engine.num_slots, engine.cache_config.pages_per_seq), np.int32)
    for slot, (position, pages) in rows.items():
        positions[slot] = position
        table[slot, : len(pages)] = pages
    return DecodeBatch(positions, table)


def test_warmup_runs_each_program_without_touching_the_state():
    params = random_params(LLAMA, seed=1)
    engine = JaxEngine(params, LLAMA, paged_cache_config(2, 64), max_prefill_chunk=16)
    before = jax.tree.map(np.asarray, engine.state)
    engine.warmup()
    after = engine.state
    assert not np.asarray(after.active).any()
    # Every write went to the null page (kv_cache.NULL_PAGE), which attention never reads.
    usable = (slice(None), slice(None), slice(1, None))
    np.testing.assert_array_equal(np.asarray(after.cache.k)[usable], before.cache.k[usable])
    np.testing.assert_array_equal(np.asarray(after.cache.v)[usable], before.cache.v[usable])
    # decode over rows it does not list leaves them as they were
    np.testing.assert_array_equal(np.asarray(after.generated)[1:], before.generated[1:])


def test_warmup_stops_before_the_mapping_limit_with_an_error(monkeypatch):
    """A limit just above what the process holds: warm-up stops after one program, with the fix in its
    message, instead of compiling until LLVM aborts the process."""
    params = random_params(LLAMA, seed=1)
    engine = JaxEngine(params, LLAMA, paged_cache_config(2, 64), max_prefill_chunk=16)
    monkeypatch.setattr(jit_mappings, "mapping_limit", lambda: jit_mappings.mapping_count() + 10)
    with pytest.raises(jit_mappings.MappingLimitError, match="vm.max_map_count"):
        engine.warmup()
    assert engine.compile_count <= 2  # the first prefill and its sampler


def test_cache_is_donated_and_updated_in_place(llama_engine):
    engine, _ = llama_engine
    before = engine.state.cache.k
    engine.decode(_batch(engine, {})).result()
    assert before.is_deleted(), "the decode step did not consume (donate) the cache"
    decode_programs = [p for key, p in engine._programs.items() if key[0] == "decode"]
    assert len(decode_programs) == 2 * 3  # 8 and 16 pages (64, 128 positions) x row buckets 1, 2, 4
    # Prefill: a forward program per (chunk, pages) bucket, all sampled by one program.
    prefill_programs = [p for key, p in engine._programs.items() if key[0] == "prefill"]
    assert len(prefill_programs) > 1
    samplers = [p for key, p in engine._programs.items() if key[0] == "prefill_sample"]
    assert len(samplers) == 1
    for program in decode_programs + prefill_programs + samplers:
        assert "input_output_alias" in program.as_text()


def test_a_slot_left_out_of_the_batch_samples_nothing(llama_engine):
    engine, _ = llama_engine
    s = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.prefill([PrefillChunk(0, [1, 2, 3], 0, s, page_ids=[5])]).result()
    assert engine.decode(_batch(engine, {0: (3, [5])})).result().valid[0]
    assert not engine.decode(_batch(engine, {})).result().valid[0]
    assert engine.decode(_batch(engine, {0: (4, [5])})).result().valid[0]


def test_invalid_chunks_raise(llama_engine):
    engine, _ = llama_engine
    s = SamplingParams()
    with pytest.raises(ValueError, match="slot"):
        engine.prefill([PrefillChunk(9, [1], 0, s, page_ids=[1])])
    with pytest.raises(ValueError, match="tokens"):
        engine.prefill([PrefillChunk(0, list(range(40)), 0, s, page_ids=[1] * 5)])
    with pytest.raises(ValueError, match="context"):
        engine.prefill([PrefillChunk(0, [1] * 10, 125, s, page_ids=[1] * 17)])
    with pytest.raises(ValueError, match="pages"):
        engine.prefill([PrefillChunk(0, [1] * 10, 0, s, page_ids=[])])
    with pytest.raises(ValueError, match="distinct"):
        engine.prefill([PrefillChunk(0, [1], 0, s, [1]), PrefillChunk(0, [2], 0, s, [2])])


def test_state_stays_on_declared_shardings(llama_engine):
    engine, _ = llama_engine
    engine.decode(_batch(engine, {})).result()
    mesh_devices = set(make_mesh().devices.flat)
    for leaf in jax.tree.leaves(engine.state):
        assert set(leaf.sharding.device_set) == mesh_devices


@pytest.mark.parametrize("quantize", [False, True])
def test_fused_projections_give_the_same_logits(quantize):
    from jaxinfer.models.params import fuse_projections
    from jaxinfer.quantization import quantize_params

    params = random_params(GEMMA, seed=5)
    if quantize:
        params = quantize_params(params)
    fused = fuse_projections(params)
    assert "qkv_proj" in fused["layers"][0] and "q_proj" not in fused["layers"][0]
    tokens = list(np.random.default_rng(2).integers(0, GEMMA.vocab_size, size=20))
    kernels = KernelConfig(int8_activations=quantize)
    want = _full_logits(params, GEMMA, tokens, kernels)
    got = _full_logits(fused, GEMMA, tokens, kernels)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_prefix_caching_and_preemption_change_no_greedy_token(llama_engine):
    """Through the orchestrator on the real engine: prompts sharing a document, a pool too small for
    every request at once (preemption) and a second turn that starts with the first turn's prompt and
    answer give the tokens of each prompt alone, prefix caching on or off."""
    from jaxinfer.orchestrator import Orchestrator

    engine, _ = llama_engine
    tok = IdTokenizer(LLAMA.vocab_size)
    rng = np.random.default_rng(11)
    document = [int(t) for t in rng.integers(0, 101, size=37)]
    prompts = [document + [int(t) for t in rng.integers(0, 101, size=n)] for n in (3, 9, 1, 14)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)  # 86-99 positions each
    short = dataclasses.replace(greedy, max_tokens=16)
    answers, follow_ups = {}, {}
    for caching in (True, False):
        orch = Orchestrator(engine, tok, enable_prefix_caching=caching).start()
        try:
            handles = [orch.submit(p, greedy) for p in prompts]
            answers[caching] = [h.collect()[0] for h in handles]
            stats = orch.stats()
            assert stats["num_preemptions"] > 0 and stats["kv_pages_used"] == 0
            assert (stats["prefix_cache_hit_tokens"] > 0) == caching
            # The next turn: the first turn's prompt and answer, then a new message.
            first = orch.submit(prompts[0], greedy).collect()[0]
            follow_up = prompts[0] + first + [5, 6, 7]
            hits = orch.stats()["prefix_cache_hit_tokens"]
            follow_ups[caching] = (follow_up, orch.submit(follow_up, short).collect()[0])
            if caching:  # every position the first turn computed but its answer's last: 87 -> 10 pages
                assert orch.stats()["prefix_cache_hit_tokens"] - hits == 80
        finally:
            orch.stop()
    alone = [generate(engine, tok, [p], [greedy])[0].token_ids for p in prompts]
    assert answers[True] == answers[False] == alone
    for follow_up, tokens in follow_ups.values():
        assert tokens == generate(engine, tok, [follow_up], [short])[0].token_ids
