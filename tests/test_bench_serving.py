"""`jaxinfer bench-serving` against a real in-process gRPC server (MockEngine + FakeTokenizer, port 0)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from jaxinfer.bench_serving import (
    BenchConfig,
    LengthDistribution,
    run_benchmark,
    run_load,
    sharegpt_requests,
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
