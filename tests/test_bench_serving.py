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
