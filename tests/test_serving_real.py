"""The real JAX engine behind the gRPC server: many concurrent clients, batching never changes a result."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json

import jsonschema
import openai
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


@pytest.fixture(scope="module")
def both_apis(runtime):
    orchestrator = Orchestrator(runtime.engine, runtime.tokenizer, max_queue=32)
    server = build_server(orchestrator, runtime.tokenizer, runtime.model_info(), port=0, http_port=0)
    yield runtime, server
    server.stop(1.0)


def test_grpc_and_http_give_the_same_tokens(both_apis):
    runtime, server = both_apis
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    model = http.models.list().data[0].id
    compiles = runtime.engine.compile_count
    with InferenceClient(f"127.0.0.1:{server.port}", timeout_s=120) as grpc_client:
        for prompt, sampling in [
            ("Once upon a time", {"temperature": 0.0}),
            ("1 2 3", {"temperature": 0.9, "seed": 11}),
        ]:
            chunks = list(grpc_client.generate(prompt, max_tokens=12, ignore_eos=True, **sampling))
            over_grpc = runtime.tokenizer.decode([t for c in chunks for t in c.token_ids])
            r = http.completions.create(
                model=model, prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True}, **sampling
            )
            assert r.choices[0].text == over_grpc and r.usage.completion_tokens == 12
    assert runtime.engine.compile_count == compiles, "something compiled while serving"


def test_logprobs_equal_transformers_and_json_follows_the_schema_on_the_device(
    both_apis, tiny_with_tokenizer
):
    """Log-probabilities come from the engine's own logits: compared with transformers' recompute of the
    whole sequence. The schema is enforced by the device-side mask on a random model."""
    import torch
    import transformers

    runtime, server = both_apis
    tok = runtime.tokenizer
    with InferenceClient(f"127.0.0.1:{server.port}", timeout_s=120) as c:
        prompt = tok.encode("The weather today")
        chunks = list(c.generate(prompt, max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=5))
    got = [lp for ch in chunks for lp in ch.logprobs]
    tokens = [t for t, _, _ in got]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.double(), -1)
    for i, (token, logprob, top) in enumerate(got):
        assert logprob == pytest.approx(want[i, token].item(), abs=2e-3)
        top_ids = [t for t, _ in top]
        assert top_ids[0] == token  # greedy: the chosen token is the most likely
        assert [v for _, v in top] == pytest.approx(want[i, top_ids].tolist(), abs=2e-3)

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    http = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0)
    model_name = http.models.list().data[0].id
    for seed in (1, 2):
        r = http.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Describe yourself as JSON."}], seed=seed,
            max_tokens=60, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "me", "schema": schema}},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_structured_output_reads_first_and_its_stop_strings_still_cut_the_text(runtime):
    """With a constrained request running, the loop reads each step before planning the next and leaves
    the detokenising until the next step is dispatched (Scheduler.flush_text): a stop string must still
    end the constrained request at the same token and text, and an unconstrained neighbour's tokens must
    not change."""
    from jaxinfer.request import StructuredKind, StructuredOutput

    tok = runtime.tokenizer
    constraint = StructuredOutput(StructuredKind.REGEX, "(ab|cd)( (ab|cd)){20}")
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [tok.encode("Pick letters:"), tok.encode("The weather today")]
    whole = SamplingParams(temperature=0.0, max_tokens=48, structured_output=constraint)
    full, alone = generate(runtime.engine, tok, prompts, [whole, free])
    assert full.text.count(" ") >= 3, full.text
    stop = " " + full.text.split(" ")[3]  # the fourth pair with its space: first seen at a known place
    with_stop = dataclasses.replace(whole, stop=(stop,))
    stopped, neighbour = generate(runtime.engine, tok, prompts, [with_stop, free])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert neighbour.token_ids == alone.token_ids
