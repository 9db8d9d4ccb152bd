"""`jaxinfer bench-serving` against a real in-process gRPC server (MockEngine + FakeTokenizer, port 0)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxinfer.bench_serving import (
    BenchConfig,
    BenchRequest,
    LengthDistribution,
    multi_turn_conversations,
    next_turn_prompt,
    run_benchmark,
    run_conversations,
    run_load,
    shared_prefix_requests,
    sharegpt_requests,
    summarize,
    synthetic_requests,
)
from jaxinfer.cli import main
from jaxinfer.client import InferenceClient
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.service import build_server
from jaxinfer.testing import FakeTokenizer, MockEngine

TOK = FakeTokenizer()
MODEL_INFO = {"model_name": "mock", "architecture": "arithmetic", "mesh": {"data": 1}}
STAT_KEYS = ["mean", "p50", "p90", "p95", "p99", "max"]


def _start(*, num_slots=4, max_seq_len=128, step_delay_s=0.004, max_queue=64):
    engine = MockEngine(
        num_slots=num_slots, max_seq_len=max_seq_len, max_prefill_chunk=8, vocab_size=TOK.vocab_size,
        step_delay_s=step_delay_s,
    )  # fmt: skip
    orchestrator = Orchestrator(engine, TOK, max_queue=max_queue)
    return build_server(orchestrator, TOK, MODEL_INFO, host="127.0.0.1", port=0)


@pytest.fixture(scope="module")
def server():
    running = _start()
    yield running
    running.stop(1.0)


def _check_stats(stats: dict) -> None:
    assert list(stats) == STAT_KEYS
    values = [stats[k] for k in STAT_KEYS[1:]]
    assert all(v is not None and v >= 0 for v in values), stats
    assert values == sorted(values), stats  # p50 <= p90 <= p95 <= p99 <= max
    assert stats["mean"] <= stats["max"]


def test_sweep_writes_a_consistent_result_file_and_plots(capsys, tmp_path, server):
    finished_before = server.orchestrator.stats()["finished"]["length"]
    result_file = tmp_path / "bench.json"
    argv = [
        "bench-serving", "--target", f"127.0.0.1:{server.port}", "--result-file", str(result_file),
        "--num-prompts", "24", "--input-len", "uniform:4,20", "--output-len", "normal:10,3",
        "--sweep-rates", "20,60", "--warmup-requests", "3", "--seed", "7",
        "--slo-ttft-ms", "30", "--slo-tpot-ms", "1000", "--plot",
    ]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    table = out.strip().splitlines()
    assert len(table) == 4 and "rate (req/s)" in table[0]  # header, separator and one row per rate
    result = json.loads(result_file.read_text())
    assert result["server"]["vocab_size"] == TOK.vocab_size
    assert result["config"]["input_len"] == "uniform:4,20"

    # The same seeded dataset, rebuilt here: the server must have produced exactly the asked lengths.
    expected = synthetic_requests(
        27, LengthDistribution("uniform", 4, 20), LengthDistribution("normal", 10, 3),
        vocab_size=TOK.vocab_size, context_length=128, seed=7,
    )[3:]  # fmt: skip
    want = sorted((len(r.prompt_token_ids), r.max_tokens) for r in expected)
    assert [run["request_rate"] for run in result["runs"]] == [20.0, 60.0]
    for run in result["runs"]:
        assert run["sent"] == 24 and run["completed"] + run["failed"] == run["sent"]
        assert run["completed"] == 24 and run["errors"] == {}
        got = sorted((r["prompt_tokens"], r["output_tokens"]) for r in run["requests"])
        assert got == want
        assert run["total_input_tokens"] == sum(p for p, _ in want)
        assert run["total_output_tokens"] == sum(o for _, o in want)
        assert math.isclose(run["output_throughput"], run["total_output_tokens"] / run["duration_s"])
        assert math.isclose(run["request_throughput"], 24 / run["duration_s"])
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            _check_stats(run[key])
        assert run["ttft_ms"]["max"] <= run["e2e_ms"]["max"]
        for r in run["requests"]:
            assert r["ok"] and r["finish_reason"] == "length" and 0 < r["ttft_s"] <= r["e2e_s"]
        good = run["goodput"]
        num_good = sum(r["ttft_s"] * 1e3 <= 30 for r in run["requests"])  # the TPOT SLO is loose
        assert good["good_requests"] == num_good
        assert math.isclose(good["requests_per_s"], num_good / run["duration_s"])
    # Poisson arrivals: the lower rate spreads the same requests over a longer time.
    sends = [sorted(r["send_s"] for r in run["requests"]) for run in result["runs"]]
    assert sends[0][-1] > 0.5 and sends[1][-1] < sends[0][-1]
    # The server saw the warm-up once and every measured request of both runs finish by length.
    assert server.orchestrator.stats()["finished"]["length"] - finished_before == 3 + 2 * 24

    pngs = [tmp_path / "bench_latency_cdf.png", tmp_path / "bench_sweep.png"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_poisson_arrivals_follow_the_seeded_schedule_and_concurrency_is_capped(server):
    requests = synthetic_requests(
        20, LengthDistribution("fixed", 6), LengthDistribution("fixed", 4),
        vocab_size=TOK.vocab_size, context_length=128, seed=1,
    )  # fmt: skip
    with InferenceClient(f"127.0.0.1:{server.port}") as client:
        results, duration = run_load(client, requests, request_rate=25.0, seed=3)
        arrivals = np.cumsum(np.random.default_rng(3).exponential(1 / 25.0, size=20))
        sends = np.array([r.send_s for r in results])
        assert np.all(sends >= arrivals - 1e-3) and np.all(sends - arrivals < 0.15), sends - arrivals
        assert duration >= arrivals[-1] - arrivals[0]

        results, _ = run_load(client, requests, max_concurrency=2)  # and request_rate=inf
    spans = [(r.send_s, r.send_s + r.e2e_s) for r in results]
    for start, _ in spans:
        in_flight = sum(s <= start < e for s, e in spans)
        assert in_flight <= 2
    assert all(r.ok and r.output_tokens == 4 for r in results)


def test_rejected_requests_count_as_failed():
    running = _start(num_slots=1, step_delay_s=0.01, max_queue=1)
    try:
        with InferenceClient(f"127.0.0.1:{running.port}") as client:
            requests = synthetic_requests(
                12, LengthDistribution("fixed", 4), LengthDistribution("fixed", 8),
                vocab_size=TOK.vocab_size, context_length=128,
            )  # fmt: skip
            results, _ = run_load(client, requests)  # all at once into one slot and a queue of one
    finally:
        running.stop(1.0)
    from jaxinfer.bench_serving import summarize

    summary = summarize(results, 1.0)
    assert summary["sent"] == 12 and summary["completed"] + summary["failed"] == 12
    assert summary["failed"] >= 1 and set(summary["errors"]) == {"RESOURCE_EXHAUSTED"}
    assert summary["total_output_tokens"] == 8 * summary["completed"]


def test_sharegpt_dataset(tmp_path, server):
    rows = [
        {"conversations": [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "the the"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn first"}]},
        {"conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "abc"},
                           {"from": "gpt", "value": "hello"}]},
        {"id": "no conversations"},
    ]  # fmt: skip
    path = tmp_path / "share.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    requests = sharegpt_requests(path, TOK.encode, num_requests=10, context_length=128)
    pairs = sorted((list(r.prompt_token_ids), r.max_tokens) for r in requests)
    out_lens = [len(TOK.encode(reply, add_bos=False)) for reply in ("the the", "hello")]
    assert pairs == sorted([(TOK.encode("hello world"), out_lens[0]), (TOK.encode("abc"), out_lens[1])])

    config = BenchConfig(
        target=f"127.0.0.1:{server.port}", dataset="sharegpt", dataset_path=str(path), num_prompts=2,
        warmup_requests=0,
    )  # fmt: skip
    [run] = run_benchmark(config)["runs"]
    assert run["completed"] == 2 and run["total_output_tokens"] == sum(out_lens)


def test_length_distributions_and_bad_inputs():
    rng = np.random.default_rng(0)
    assert LengthDistribution.parse("64") == LengthDistribution("fixed", 64)
    uniform = LengthDistribution.parse("uniform:5,9").sample(rng, 2000)
    assert uniform.min() == 5 and uniform.max() == 9
    normal = LengthDistribution.parse("normal:100,10").sample(rng, 4000)
    assert abs(normal.mean() - 100) < 1 and abs(normal.std() - 10) < 1
    assert LengthDistribution.parse("normal:2,50").sample(rng, 100).min() >= 1
    for spec in ("uniform:9,5", "fixed:0", "poisson:3", "uniform:4", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDistribution.parse(spec)
    with pytest.raises(ValueError, match="no jaxinfer server"):
        run_benchmark(BenchConfig(target="127.0.0.1:1", connect_timeout_s=0.3))


def _common_prefix_len(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_shared_prefix_prompts_share_exactly_the_document():
    fixed = LengthDistribution("fixed", 12)
    requests = shared_prefix_requests(
        30, 200, fixed, LengthDistribution("fixed", 5), vocab_size=TOK.vocab_size, context_length=512, seed=3
    )
    document = requests[0].prompt_token_ids[:200]
    assert all(len(r.prompt_token_ids) == 212 and r.max_tokens == 5 for r in requests)
    assert all(r.prompt_token_ids[:200] == document for r in requests)
    questions = [r.prompt_token_ids[200:] for r in requests]
    assert len({q[0] for q in questions}) == 30  # distinct from their first token on
    for i, a in enumerate(requests):
        for b in requests[i + 1 :]:
            assert _common_prefix_len(a.prompt_token_ids, b.prompt_token_ids) == 200
    # The same seed gives the same prompts; another seed another document.
    again = shared_prefix_requests(
        30, 200, fixed, LengthDistribution("fixed", 5), vocab_size=TOK.vocab_size, context_length=512, seed=3
    )
    assert again == requests
    other = shared_prefix_requests(
        2, 200, fixed, fixed, vocab_size=TOK.vocab_size, context_length=512, seed=4
    )
    assert other[0].prompt_token_ids[:200] != document
    # Question lengths follow their distribution; question and output are clipped to the context.
    uniform = shared_prefix_requests(
        50, 10, LengthDistribution("uniform", 3, 9), fixed, vocab_size=TOK.vocab_size, context_length=512
    )
    assert {len(r.prompt_token_ids) - 10 for r in uniform} == set(range(3, 10))
    tight = shared_prefix_requests(
        4, 20, LengthDistribution("fixed", 30), fixed, vocab_size=TOK.vocab_size, context_length=32
    )
    assert all(len(r.prompt_token_ids) == 31 and r.max_tokens == 1 for r in tight)
    with pytest.raises(ValueError, match="shared_prefix_len"):
        shared_prefix_requests(2, 31, fixed, fixed, vocab_size=TOK.vocab_size, context_length=32)


def test_multi_turn_plan_fits_the_context():
    firsts = [BenchRequest((1, 2, 3), 4), BenchRequest(tuple(range(20)), 4)]
    conversations = multi_turn_conversations(
        firsts, 4, LengthDistribution("fixed", 5), LengthDistribution("fixed", 6),
        vocab_size=TOK.vocab_size, context_length=40, seed=0,
    )  # fmt: skip
    short, long = conversations
    assert short.num_turns == 4 and [len(f.prompt_token_ids) for f in short.follow_ups] == [5, 5, 5]
    assert [f.max_tokens for f in short.follow_ups] == [6, 6, 6]  # 3 + 4 + 3 * 11 = 40
    # 20 + 4, then 5 + 6 (35), then the message clipped to 4 with one output token (40); no room for more.
    assert [(len(f.prompt_token_ids), f.max_tokens) for f in long.follow_ups] == [(5, 6), (4, 1)]
    assert next_turn_prompt((1, 2), [3], (4, 5)) == (1, 2, 3, 4, 5)


def test_multi_turn_prompts_extend_the_previous_turn(server):
    firsts = shared_prefix_requests(
        6, 24, LengthDistribution("fixed", 5), LengthDistribution("fixed", 4),
        vocab_size=TOK.vocab_size, context_length=128, seed=2,
    )  # fmt: skip
    conversations = multi_turn_conversations(
        firsts, 3, LengthDistribution("fixed", 3), LengthDistribution("fixed", 4),
        vocab_size=TOK.vocab_size, context_length=128, seed=2,
    )  # fmt: skip
    sent = {}  # (conversation, turn) -> (prompt, output)

    def on_turn(conversation, turn, prompt, output):
        sent[conversation, turn] = (prompt, output)

    with InferenceClient(f"127.0.0.1:{server.port}") as client:
        results, duration = run_conversations(
            client, conversations, max_concurrency=3, sampling={"temperature": 0.0}, on_turn=on_turn
        )
    assert len(results) == 18 and all(r.ok and r.output_tokens == 4 for r in results)
    assert sorted((r.conversation, r.turn) for r in results) == sorted(sent)
    for c, conversation in enumerate(conversations):
        prompt, output = sent[c, 1]
        assert prompt == conversation.first.prompt_token_ids and len(output) == 4
        for turn, follow_up in enumerate(conversation.follow_ups, start=2):
            previous_prompt, previous_output = sent[c, turn - 1]
            prompt, output = sent[c, turn]
            assert prompt == previous_prompt + tuple(previous_output) + follow_up.prompt_token_ids
            assert len(prompt) == 29 + (turn - 1) * 7
        # Turns of one conversation run one after the other.
        spans = sorted((r.send_s, r.send_s + r.e2e_s) for r in results if r.conversation == c)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    summary = summarize(results, duration)
    assert summary["conversations"] == 6 and summary["completed_by_turn"] == {"1": 6, "2": 6, "3": 6}
    assert set(summary["ttft_ms_by_turn"]) == {"1", "2", "3"}
    _check_stats(summary["ttft_ms_first_turn"])
    _check_stats(summary["ttft_ms_later_turns"])


def test_cli_shared_prefix_multi_turn_run(capsys, tmp_path, server):
    hits_before = server.orchestrator.stats()["prefix_cache_hit_tokens"]
    result_file = tmp_path / "bench.json"
    argv = [
        "bench-serving", "--target", f"127.0.0.1:{server.port}", "--result-file", str(result_file),
        "--num-prompts", "5", "--shared-prefix-len", "32", "--input-len", "6", "--output-len", "3",
        "--multi-turn", "2", "--turn-input-len", "4", "--warmup-requests", "2", "--max-concurrency", "5",
    ]  # fmt: skip
    assert main(argv) == 0
    out, _ = capsys.readouterr()
    assert "TTFT p50 / p99 turn 1" in out and "later turns" in out
    result = json.loads(result_file.read_text())
    config = result["config"]
    assert (config["shared_prefix_len"], config["multi_turn"], config["turn_input_len"]) == (32, 2, "fixed:4")
    [run] = result["runs"]
    assert run["sent"] == run["completed"] == 10 and run["conversations"] == 5
    assert set(run["ttft_ms_by_turn"]) == {"1", "2"}
    by_turn = {t: sorted(r["prompt_tokens"] for r in run["requests"] if r["turn"] == t) for t in (1, 2)}
    assert by_turn == {1: [38] * 5, 2: [38 + 3 + 4] * 5}
    # The server found the shared document (and each first turn, for the second) in its prefix cache.
    assert server.orchestrator.stats()["prefix_cache_hit_tokens"] > hits_before


# ---- the OpenAI-compatible HTTP backend ----------------------------------------------------------------

API_KEY = "bench-key"


@pytest.fixture(scope="module")
def keyed_server():
    """gRPC and the OpenAI HTTP API over one orchestrator, both behind an API key."""
    engine = MockEngine(
        num_slots=4, max_seq_len=128, max_prefill_chunk=8, vocab_size=TOK.vocab_size, step_delay_s=0.004
    )
    orchestrator = Orchestrator(engine, TOK, max_queue=64)
    running = build_server(
        orchestrator, TOK, MODEL_INFO, host="127.0.0.1", port=0, http_port=0, api_key=API_KEY
    )
    yield running
    running.stop(1.0)


def test_openai_backend_over_http_gives_the_grpc_report(capsys, tmp_path, keyed_server):
    finished_before = keyed_server.orchestrator.stats()["finished"]["length"]
    common = [
        "--num-prompts", "16", "--input-len", "uniform:4,20", "--output-len", "normal:10,3",
        "--warmup-requests", "2", "--seed", "5", "--api-key", API_KEY, "--max-concurrency", "6",
    ]  # fmt: skip
    http_file, grpc_file = tmp_path / "http.json", tmp_path / "grpc.json"
    base = f"http://127.0.0.1:{keyed_server.http_port}"
    argv = ["bench-serving", "--backend", "openai", "--target", base, "--result-file", str(http_file)]
    assert main([*argv, "--vocab-size", str(TOK.vocab_size), *common]) == 0
    http_out, http_err = capsys.readouterr()
    assert f"backend openai: {base}, model mock" in http_err
    grpc_target = f"127.0.0.1:{keyed_server.port}"
    argv = ["bench-serving", "--target", grpc_target, "--result-file", str(grpc_file)]
    assert main([*argv, *common]) == 0
    grpc_out, grpc_err = capsys.readouterr()
    assert f"backend grpc: {grpc_target}" in grpc_err

    http, grpc_result = json.loads(http_file.read_text()), json.loads(grpc_file.read_text())
    assert http["config"]["backend"] == "openai" and grpc_result["config"]["backend"] == "grpc"
    assert "api_key" not in http["config"] and API_KEY not in http_file.read_text()
    assert http["server"]["model_name"] == "mock" and http["server"]["context_length"] == 128
    # The same report: the table's header and the keys of the run and of each request.
    assert http_out.splitlines()[:2] == grpc_out.splitlines()[:2] and len(http_out.splitlines()) == 3
    [run], [grpc_run] = http["runs"], grpc_result["runs"]
    assert set(run) == set(grpc_run) and set(run["requests"][0]) == set(grpc_run["requests"][0])

    # Exact lengths over HTTP (the usage chunk's count): the seeded dataset, rebuilt here.
    expected = synthetic_requests(
        18, LengthDistribution("uniform", 4, 20), LengthDistribution("normal", 10, 3),
        vocab_size=TOK.vocab_size, context_length=128, seed=5,
    )[2:]  # fmt: skip
    want = sorted((len(r.prompt_token_ids), r.max_tokens) for r in expected)
    for result in (run, grpc_run):
        assert result["sent"] == result["completed"] == 16
        assert result["failed"] == 0 and result["errors"] == {}
        assert sorted((r["prompt_tokens"], r["output_tokens"]) for r in result["requests"]) == want
        for r in result["requests"]:
            assert r["ok"] and r["finish_reason"] == "length" and 0 < r["ttft_s"] <= r["e2e_s"]
            if r["output_tokens"] > 1:
                assert r["tpot_s"] > 0 and math.isclose(
                    r["tpot_s"], (r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
                )
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            _check_stats(result[key])
        assert math.isclose(result["output_throughput"], result["total_output_tokens"] / result["duration_s"])
    # The MockEngine decodes a step every 4 ms: the gaps between HTTP chunks average about that. (A
    # loaded client reads several chunks at once, so the median gap may be near zero; bunching keeps the
    # gaps' sum, the first chunk to the last, and so their mean.)
    assert 2 <= run["itl_ms"]["mean"] < 100
    # Warm-up and measured requests of both runs ran on the server, to their max_tokens.
    assert keyed_server.orchestrator.stats()["finished"]["length"] - finished_before == 2 * (2 + 16)


def test_openai_backend_counts_http_errors_as_failed(keyed_server):
    from jaxinfer.bench_serving import OpenAIClient

    base = f"127.0.0.1:{keyed_server.http_port}/v1/"  # no scheme, a trailing /v1: the same base URL
    with (
        pytest.raises(ValueError, match="HTTP 401: missing or incorrect API key"),
        OpenAIClient(base) as client,
    ):
        client.model_info()
    with OpenAIClient(base, api_key=API_KEY) as client:
        assert client.base_url == f"http://127.0.0.1:{keyed_server.http_port}"
        assert client.model_info()["model_name"] == "mock" and client.model == "mock"
        good = BenchRequest((5, 6, 7), 4)
        outside = BenchRequest((5, TOK.vocab_size + 3), 4)  # a token id the model does not have
        results, _ = run_load(client, [good, outside, good], sampling={"temperature": 0.0})
        with pytest.raises(ValueError, match="multi-turn"):
            run_conversations(client, multi_turn_conversations(
                [good], 2, LengthDistribution("fixed", 2), LengthDistribution("fixed", 2),
                vocab_size=TOK.vocab_size, context_length=128,
            ))  # fmt: skip
    assert [r.ok for r in results] == [True, False, True]
    assert [r.output_tokens for r in results] == [4, 0, 4]
    bad = results[1]
    assert bad.error.startswith("HTTP 400: ") and "outside the vocabulary" in bad.error
    assert bad.ttft_s is None and bad.e2e_s is not None
    assert summarize(results, 1.0)["errors"] == {bad.error: 1}

    # A wrong key, no server, a dataset the OpenAI API cannot serve: clear errors before any load.
    keyed = dict(backend="openai", target=f"http://127.0.0.1:{keyed_server.http_port}")
    with pytest.raises(ValueError, match="HTTP 401"):
        run_benchmark(BenchConfig(**keyed, api_key="wrong", vocab_size=TOK.vocab_size))
    with pytest.raises(ValueError, match="no OpenAI-compatible server"):
        run_benchmark(BenchConfig(backend="openai", target="http://127.0.0.1:1", connect_timeout_s=0.3))
    with pytest.raises(ValueError, match="refused the API key"):
        run_benchmark(BenchConfig(target=f"127.0.0.1:{keyed_server.port}", api_key="wrong"))
    with pytest.raises(ValueError, match="tokenizer"):
        BenchConfig(backend="openai", dataset="sharegpt", dataset_path="x.json")
    with pytest.raises(ValueError, match="multi-turn"):
        BenchConfig(backend="openai", multi_turn=2)
    assert BenchConfig(backend="openai").target == "http://127.0.0.1:8000"
    assert BenchConfig().target == "127.0.0.1:50051"


def test_openai_stream_parsing_without_usage_and_with_a_mid_stream_error():
    """Other OpenAI servers: no usage chunk (chunks are counted), an error event after the 200."""
    import httpx

    from jaxinfer.bench_serving import OpenAIClient

    def sse(*events) -> bytes:
        return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()

    def chunk(text, finish=None) -> dict:
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}

    bodies = {
        "plain": sse(chunk("a"), chunk(""), chunk("c", "stop"), "[DONE]"),
        "broken": sse(chunk("a"), {"error": {"message": "the server failed while generating"}}, "[DONE]"),
        "cut": sse(chunk("a"), chunk("b")),  # the connection ends with no finish
    }
    sent = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append(body)
        kind = {1: "plain", 2: "broken", 3: "cut"}[len(body["prompt"])]
        return httpx.Response(200, content=bodies[kind], headers={"content-type": "text/event-stream"})

    with OpenAIClient("http://bench.invalid") as client:
        client._http.close()  # the same client, over a transport that answers from `bodies`
        client._http = httpx.Client(base_url=client.base_url, transport=httpx.MockTransport(handler))
        client.model = "m"
        requests = [BenchRequest((1,), 3), BenchRequest((1, 2), 3), BenchRequest((1, 2, 3), 3)]
        results, _ = run_load(
            client, requests, max_concurrency=1, sampling={"temperature": 0.5, "seed": 9}, ignore_eos=False
        )
    plain, broken, cut = results
    assert plain.ok and plain.finish_reason == "stop" and plain.output_tokens == 3 and len(plain.itl_s) == 2
    assert broken.error == "stream error: the server failed while generating"
    assert cut.error == "finish_None" and cut.output_tokens == 2
    assert sent[0] == {
        "model": "m", "prompt": [1], "max_tokens": 3, "ignore_eos": False, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0.5, "seed": 9,
    }  # fmt: skip
