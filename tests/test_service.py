"""The gRPC service end to end: a real server on 127.0.0.1 (port 0) over MockEngine + FakeTokenizer."""

import dataclasses
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from jaxinfer.client import InferenceClient, client_main
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.proto.jaxinfer.v1 import inference_pb2 as pb
from jaxinfer.proto.jaxinfer.v1 import inference_pb2_grpc as pb_grpc
from jaxinfer.request import SamplingParams
from jaxinfer.service import SERVICE_NAME, build_server
from jaxinfer.testing import FakeTokenizer, MockEngine, wait_until

TOK = FakeTokenizer()
MODEL_INFO = {
    "model_name": "mock",
    "architecture": "arithmetic",
    "mesh": {"data": 1, "model": 1},
    "dtype": "float32",
    "quantization": "none",
}


def start(
    *, num_slots=4, max_seq_len=64, step_delay_s=0.001, max_queue=64, fail_at_decode=None, num_pages=None
):
    engine = MockEngine(
        num_slots=num_slots,
        max_seq_len=max_seq_len,
        max_prefill_chunk=8,
        vocab_size=TOK.vocab_size,
        num_pages=num_pages,
        step_delay_s=step_delay_s,
        fail_at_decode=fail_at_decode,
    )
    orch = Orchestrator(engine, TOK, max_queue=max_queue)
    running = build_server(orch, TOK, MODEL_INFO, host="127.0.0.1", port=0, metrics_port=0)
    return engine, running


@pytest.fixture(scope="module")
def server():
    engine, running = start()
    yield engine, running
    running.stop(1.0)


def expected(engine, prompt, sampling):
    stop_ids = tuple(sampling.stop_token_ids) + (() if sampling.ignore_eos else TOK.eos_ids)
    return engine.reference_tokens(prompt, dataclasses.replace(sampling, stop_token_ids=stop_ids))


def collect(stream):
    chunks = list(stream)
    tokens = [t for c in chunks for t in c.token_ids]
    return tokens, "".join(c.text for c in chunks), chunks[-1]


def test_concurrent_streaming_clients_get_exact_tokens_and_no_slot_leaks(server):
    engine, running = server
    target = f"127.0.0.1:{running.port}"
    rng = random.Random(0)
    jobs = []
    for i in range(24):
        kind = ("text", "ids", "chat")[i % 3]
        sampling = dict(seed=rng.randrange(4), temperature=rng.choice([0.0, 0.8]), top_k=rng.choice([0, 5]))
        max_tokens = rng.randint(1, 24)
        if kind == "text":
            prompt = rng.choice(["hello world", "the é", "abc", "x"])
            ids = TOK.encode(prompt)
            kwargs = dict(prompt=prompt)
        elif kind == "ids":
            ids = [rng.randrange(TOK.vocab_size) for _ in range(rng.randint(1, 20))]
            kwargs = dict(prompt=ids)
        else:
            chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"hi {i}"}]
            ids = TOK.encode_chat(chat)
            kwargs = dict(chat=chat)
        jobs.append((kwargs, ids, SamplingParams(max_tokens=max_tokens, **sampling)))
    results = [None] * len(jobs)

    def client(i):
        kwargs, _, sp = jobs[i]
        with InferenceClient(target, timeout_s=30) as c:
            options = dict(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed)
            results[i] = collect(c.generate(**kwargs, max_tokens=sp.max_tokens, **options))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for (_, ids, sp), (tokens, text, last) in zip(jobs, results, strict=True):
        want = expected(engine, ids, sp)
        assert tokens == want and text == TOK.decode(want)
        assert last.finish_reason == ("stop" if want[-1] in TOK.eos_ids else "length")
        assert last.usage["prompt_tokens"] == len(ids) and last.usage["completion_tokens"] == len(want)
        assert 0 < last.usage["ttft_s"] <= last.usage["e2e_s"]
    stats = running.orchestrator.stats()
    assert stats["num_free_slots"] == 4 and stats["num_live"] == 0 and stats["kv_pages_used"] == 0


def test_stop_strings_and_stop_token_ids(server):
    engine, running = server
    with InferenceClient(f"127.0.0.1:{running.port}") as c:
        a_id = TOK.encode("a", add_bos=False)
        tokens, text, last = collect(c.generate(a_id, max_tokens=20, stop=["de"], seed=0))
        assert text == "bc" and tokens == TOK.encode("bcde", add_bos=False) and last.finish_reason == "stop"
        f_id = TOK.encode("f", add_bos=False)[0]
        tokens, text, last = collect(c.generate(a_id, max_tokens=20, stop_token_ids=[f_id], seed=0))
        assert text == "bcdef" and last.finish_reason == "stop"


INVALID = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="hi", max_tokens=0), "max_tokens=0 must be > 0"),
    (dict(prompt="hi", max_tokens=-3), "max_tokens=-3 must be > 0"),
    (dict(prompt="hi", sampling=pb.SamplingOptions(temperature=-1.0)), "temperature=-1.0 must be >= 0"),
    (dict(prompt="hi", sampling=pb.SamplingOptions(top_p=0.0)), "top_p=0.0 must be in (0, 1]"),
    (dict(prompt="hi", sampling=pb.SamplingOptions(top_p=1.5)), "top_p=1.5 must be in (0, 1]"),
    (dict(prompt_token_ids=[5, 100_000]), "prompt_token_ids [100000] are outside the vocabulary"),
    (dict(prompt_token_ids=[5, -2]), "outside the vocabulary"),
    (dict(chat=[pb.ChatMessage(role="wizard", content="x")]), "chat[0].role='wizard'"),
    (dict(prompt="hi", max_tokens=63), "exceeds the context length 64"),
    (dict(prompt="hi", prompt_token_ids=[5]), "exactly one of prompt, prompt_token_ids and chat"),
    (dict(prompt="hi", stop_token_ids=[999]), "stop_token_ids"),
    (dict(prompt="hi", stop=[""]), "stop strings must be non-empty"),
    (dict(prompt="\u4e2d"), "cannot encode"),
    (
        dict(prompt="hi", sampling=pb.SamplingOptions(speculative="medusa")),
        "speculative='medusa' must be one of",
    ),
    (dict(prompt="hi", sampling=pb.SamplingOptions(speculative="ngram")), "without speculative decoding"),
    (
        dict(prompt="hi", sampling=pb.SamplingOptions(num_draft_tokens=9)),
        "num_draft_tokens=9 must be in [0, 7]",
    ),
]


@pytest.mark.parametrize("fields, message", INVALID, ids=[m for _, m in INVALID])
def test_invalid_arguments(server, fields, message):
    _, running = server
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(**fields), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_tokenize_detokenize_and_model_info(server):
    engine, running = server
    with InferenceClient(f"127.0.0.1:{running.port}", timeout_s=5) as c:
        assert c.tokenize("hello é") == TOK.encode("hello é")
        assert c.tokenize("hello", add_bos=False) == TOK.encode("hello", add_bos=False)
        ids = TOK.encode("the é😀")
        assert c.detokenize(ids) == "the é😀"
        assert c.detokenize([1, 2], skip_special=False) == TOK.decode([1, 2], skip_special=False)
        with pytest.raises(grpc.RpcError) as info:
            c.detokenize([TOK.vocab_size])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        info = c.model_info()
    assert info["model_name"] == "mock" and info["mesh"] == {"data": 1, "model": 1}
    assert info["vocab_size"] == TOK.vocab_size and info["num_slots"] == engine.num_slots
    assert info["context_length"] == engine.max_seq_len and info["quantization"] == "none"
    assert info["page_size"] == engine.page_size and info["num_kv_pages"] == engine.num_pages - 1
    assert info["prefix_caching"] is True


def test_health_and_reflection_with_stock_clients(server):
    _, running = server
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            response = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert SERVICE_NAME in services and "grpc.health.v1.Health" in services
        file_proto = db.FindFileContainingSymbol("jaxinfer.v1.GenerateRequest")
        assert file_proto.package == "jaxinfer.v1"
        methods = {m.name for m in file_proto.service[0].method}
        assert methods == {"Generate", "Tokenize", "Detokenize", "GetModelInfo"}


def test_metrics_endpoint_serves_prometheus_text(server):
    _, running = server
    with InferenceClient(f"127.0.0.1:{running.port}") as c:
        collect(c.generate("hello", max_tokens=5, seed=1))
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5).read().decode()
    )
    for name in ("queue_time", "ttft", "tpot", "itl", "e2e"):
        assert f"jaxinfer_{name}_seconds_bucket" in body
        assert f'jaxinfer_{name}_window_seconds{{quantile="0.99"}}' in body
    for gauge in ("jaxinfer_slot_occupancy", "jaxinfer_kv_cache_utilization", "jaxinfer_queue_depth"):
        assert re.search(rf"^{gauge} 0\.0$", body, re.M), gauge
    finished = sum(running.orchestrator.stats()["finished"].values())
    counts = [
        float(v) for v in re.findall(r'^jaxinfer_requests_total\{finish_reason="\w+"\} (\S+)$', body, re.M)
    ]
    assert sum(counts) == finished
    ttft_count = float(re.search(r"^jaxinfer_ttft_seconds_count (\S+)$", body, re.M).group(1))
    assert ttft_count == finished
    assert "jaxinfer_decode_tokens_per_second" in body and "jaxinfer_prefill_tokens_per_second" in body


def test_client_main_streams_text(server, capsys):
    engine, running = server
    status = client_main(["abc", "--target", f"127.0.0.1:{running.port}", "--max-tokens", "4", "--seed", "0"])
    assert status == 0
    want = expected(engine, TOK.encode("abc"), SamplingParams(max_tokens=4, seed=0))
    out = capsys.readouterr()
    assert out.out == TOK.decode(want) + "\n"
    assert "[length]" in out.err


def occupancy(running):
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{running.metrics_port}/metrics", timeout=5).read().decode()
    )
    return float(re.search(r"^jaxinfer_slot_occupancy (\S+)$", body, re.M).group(1))


def test_resource_exhausted_cancel_and_deadline_free_slots():
    engine, running = start(num_slots=1, max_queue=1, step_delay_s=0.01)
    target = f"127.0.0.1:{running.port}"
    try:
        with InferenceClient(target) as c:
            # A long stream holds the only slot; one more waits; the next is refused at once.
            holder = c.generate("a", max_tokens=60, seed=0, ignore_eos=True)
            it = iter(holder)
            first = next(it)
            assert first.token_ids
            waiter = c.generate("b", max_tokens=2, ignore_eos=True)
            wait_until(lambda: running.orchestrator.stats()["num_waiting"] == 1)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                collect(c.generate("c", max_tokens=2))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() - t0 < 1.0
            # Client cancel mid-stream frees the slot: the waiter runs to completion.
            next(it)
            holder.cancel()
            assert collect(waiter)[2].finish_reason == "length"
            wait_until(lambda: running.orchestrator.stats()["finished"]["cancelled"] == 1)
            # Deadline mid-stream: the client sees DEADLINE_EXCEEDED, the server frees the slot.
            with pytest.raises(grpc.RpcError) as info:
                collect(c.generate("d", max_tokens=60, ignore_eos=True, timeout_s=0.15))
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_until(lambda: running.orchestrator.stats()["finished"]["cancelled"] == 2)
            wait_until(lambda: occupancy(running) == 0.0)
            stats = running.orchestrator.stats()
            assert stats["num_free_slots"] == 1 and stats["kv_pages_used"] == 0
    finally:
        running.stop(1.0)


def test_graceful_shutdown_finishes_in_flight_and_refuses_new_work():
    engine, running = start(num_slots=2, step_delay_s=0.01)
    target = f"127.0.0.1:{running.port}"
    with InferenceClient(target) as c, grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stream = c.generate("a", max_tokens=40, ignore_eos=True)
        it = iter(stream)
        chunks = [next(it)]
        stopper = threading.Thread(target=running.stop, args=(10.0,))
        stopper.start()
        wait_until(
            lambda: (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        )
        with pytest.raises(grpc.RpcError) as info:
            collect(c.generate("b", max_tokens=2))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(it)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(ch.token_ids) for ch in chunks) == 40
        stopper.join(10)
        assert running.wait(0) and not running.failed
    assert running.orchestrator.stats()["kv_pages_used"] == 0


def test_engine_failure_stops_the_server():
    engine, running = start(num_slots=2, step_delay_s=0.002, fail_at_decode=5)
    with InferenceClient(f"127.0.0.1:{running.port}") as c:
        tokens, _, last = collect(c.generate("a", max_tokens=30, ignore_eos=True))
    assert last.finish_reason == "error" and len(tokens) < 30
    assert running.wait(5.0) and running.failed


SERVE_SCRIPT = """
import logging, sys
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.service import serve_forever
from jaxinfer.testing import FakeTokenizer, MockEngine
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
tok = FakeTokenizer()
engine = MockEngine(num_slots=2, vocab_size=tok.vocab_size, step_delay_s=0.01)
sys.exit(serve_forever(Orchestrator(engine, tok), tok, {"model_name": "mock"}, host="127.0.0.1", port=0))
"""


def test_serve_forever_drains_in_flight_requests_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT], stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in proc.stderr:
            if match := re.search(r"serving on 127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                break
        assert port is not None
        with InferenceClient(f"127.0.0.1:{port}") as c:
            stream = c.generate("a", max_tokens=30, ignore_eos=True)
            first = next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(ch.token_ids) for ch in rest) == 30
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_64_clients_with_random_cancels_on_a_small_pool_leave_it_whole():
    """More demand than pages: requests wait, the newest are preempted, clients cancel at random; every
    finished stream is exact, a request too big for the whole pool is INVALID_ARGUMENT, and at the end
    every page and slot is free."""
    engine, running = start(num_slots=8, max_seq_len=160, num_pages=33, max_queue=64)  # 32 pages of 4
    target = f"127.0.0.1:{running.port}"
    rng = random.Random(5)
    document = [rng.randrange(3, TOK.vocab_size) for _ in range(16)]
    jobs = []
    for i in range(64):
        head = document if i % 2 else []
        prompt = head + [rng.randrange(3, TOK.vocab_size) for _ in range(rng.randint(1, 12))]
        sampling = SamplingParams(max_tokens=rng.randint(1, 64 - len(prompt)), seed=i % 4, ignore_eos=True)
        jobs.append((prompt, sampling, rng.random() < 0.3))  # (.., cancel after a few tokens)
    results = [None] * len(jobs)

    def client(i):
        prompt, sp, cancel = jobs[i]
        with InferenceClient(target, timeout_s=60) as c:
            stream = c.generate(prompt, max_tokens=sp.max_tokens, seed=sp.seed, ignore_eos=True)
            tokens = []
            try:
                for chunk in stream:
                    tokens += chunk.token_ids
                    if cancel and len(tokens) >= 2:
                        stream.cancel()
                        break
                    if chunk.finish_reason is not None:
                        results[i] = (tokens, chunk.finish_reason)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.CANCELLED
            if results[i] is None:
                results[i] = (tokens, "cancelled")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    with InferenceClient(target, timeout_s=10) as c, pytest.raises(grpc.RpcError) as info:
        collect(c.generate(list(range(3, 40)), max_tokens=100, ignore_eos=True))  # 137 positions > 128
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pool" in info.value.details()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for (prompt, sp, cancel), (tokens, reason) in zip(jobs, results, strict=True):
        want = expected(engine, prompt, sp)
        if reason == "cancelled":
            assert cancel and tokens == want[: len(tokens)]
        else:
            assert tokens == want and reason == "length"
    wait_until(lambda: running.orchestrator.stats()["num_live"] == 0)
    stats = running.orchestrator.stats()
    assert stats["kv_pages_used"] == 0 and stats["num_free_slots"] == 8
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_preemptions"] > 0
    running.orchestrator._scheduler.pool.check()
    running.stop(1.0)
