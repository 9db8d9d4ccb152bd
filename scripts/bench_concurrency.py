"""Aggregate decode tokens/s through the gRPC server at several client concurrencies.

    .venv/bin/python scripts/bench_concurrency.py [--model smollm2-135m-instruct] [--concurrency 1 4 8 16 32]

Starts `jaxinfer serve` in process (all programs compiled first), then for each concurrency N keeps N
streaming clients busy with fixed-length requests (prompt 32 tokens, 64 output tokens, greedy,
ignore_eos) and reports output tokens/s, TTFT and TPOT percentiles, next to the concurrency-1 figure.
The slot count is the largest concurrency, so no request waits for a slot.
"""

from __future__ import annotations

import argparse

from jaxinfer.bench_serving import LengthDistribution, run_load, summarize, synthetic_requests
from jaxinfer.client import InferenceClient
from jaxinfer.orchestrator import Orchestrator
from jaxinfer.runtime import RuntimeOptions, build_runtime
from jaxinfer.service import build_server


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    args = parser.parse_args()

    slots = max(args.concurrency)
    options = RuntimeOptions(
        model=args.model, num_slots=slots, max_len=256, max_prefill_chunk=64, quantize=args.quantize
    )
    runtime = build_runtime(options)
    seconds = runtime.engine.warmup()
    print(f"{args.model} ({args.quantize}): {slots} slots, warm-up {seconds:.1f}s")
    orchestrator = Orchestrator(runtime.engine, runtime.tokenizer, max_queue=4 * slots)
    server = build_server(orchestrator, runtime.tokenizer, runtime.model_info(), port=0)
    rows = []
    try:
        with InferenceClient(f"127.0.0.1:{server.port}", timeout_s=600) as client:
            for n in args.concurrency:
                requests = synthetic_requests(
                    n * args.requests_per_client,
                    LengthDistribution("fixed", args.input_len),
                    LengthDistribution("fixed", args.output_len),
                    vocab_size=runtime.tokenizer.vocab_size,
                    context_length=options.max_len,
                    seed=n,
                )
                results, duration = run_load(
                    client, requests, max_concurrency=n, sampling={"temperature": 0.0}, timeout_s=600
                )
                s = summarize(results, duration)
                rows.append((n, s))
                print(f"concurrency {n}: {s['output_throughput']:.1f} output tok/s", flush=True)
    finally:
        server.stop(2.0)

    base = rows[0][1]["output_throughput"]
    print(f"\n{'clients':>8}{'output tok/s':>14}{'x batch 1':>11}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
          f"{'TPOT p99 ms':>13}{'failed':>8}")  # fmt: skip
    for n, s in rows:
        print(
            f"{n:>8}{s['output_throughput']:14.1f}{s['output_throughput'] / base:10.2f}x"
            f"{s['ttft_ms']['p50']:13.0f}{s['tpot_ms']['p50']:13.1f}{s['tpot_ms']['p99']:13.1f}{s['failed']:>8}"
        )


if __name__ == "__main__":
    main()
