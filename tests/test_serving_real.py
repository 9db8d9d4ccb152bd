"""The real JAX engine behind the gRPC server: many concurrent clients, batching never changes a result."""

from __future__ import annotations

import concurrent.futures

import pytest

from jaxinfer.client import InferenceClient
from jaxinfer.generate import generate
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.request import SamplingParams
from jaxinfer.runtime import RuntimeOptions, build_runtime
from jaxinfer.service import build_server

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog. " * 3,  # two prefill chunks of 32
    "1 2 3 4 5",
    "Once upon a time",
    "def f(x):\n    return x * 2",
    "¿Dónde está la biblioteca? 图书馆在哪里？",
]


def _requests():
    """(prompt, SamplingParams) pairs: greedy and seeded sampling, mixed lengths."""
    out = []
    for i, prompt in enumerate(PROMPTS * 2):
        if i % 2:
            s = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=100 + i, max_tokens=4 + i)
        else:
            s = SamplingParams(temperature=0.0, max_tokens=3 + 2 * i)
        out.append((prompt, SamplingParams(**{**s.__dict__, "ignore_eos": True})))
    return out


@pytest.fixture(scope="module")
def runtime(tiny_with_tokenizer):
    options = RuntimeOptions(
        model=str(tiny_with_tokenizer), num_slots=4, max_len=128, max_prefill_chunk=32,
        compilation_cache_dir=None,
    )  # fmt: skip
    runtime = build_runtime(options)
    runtime.engine.warmup()
    return runtime


def test_concurrent_clients_get_the_offline_results_and_no_slot_leaks(runtime):
    tok, engine = runtime.tokenizer, runtime.engine
    requests = _requests()
    expected = [
        generate(engine, tok, [tok.encode(p)], [s])[0].token_ids for p, s in requests
    ]  # each request alone
    compiles = engine.compile_count
    orchestrator = Orchestrator(engine, tok, max_queue=32)
    server = build_server(orchestrator, tok, runtime.model_info(), port=0)
    try:

        def call(request):
            prompt, s = request
            with InferenceClient(f"127.0.0.1:{server.port}", timeout_s=120) as client:
                chunks = list(
                    client.generate(
                        prompt,
                        max_tokens=s.max_tokens,
                        ignore_eos=True,
                        temperature=s.temperature,
                        top_k=s.top_k,
                        top_p=s.top_p,
                        seed=s.seed,
                    )  # fmt: skip
                )
            return [t for c in chunks for t in c.token_ids], chunks[-1]

        with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(call, requests))
        for (tokens, last), want, (_, s) in zip(results, expected, requests):
            assert tokens == want
            assert last.finish_reason == "length" and len(tokens) == s.max_tokens
        stats = orchestrator.stats()
        assert stats["num_free_slots"] == engine.num_slots and stats["num_live"] == 0
        assert engine.compile_count == compiles, "something compiled while serving"
    finally:
        server.stop(1.0)
