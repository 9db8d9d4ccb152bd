"""How many requests the paged KV cache runs at once in the memory the old slot cache reserved.

    .venv/bin/python scripts/bench_kv_capacity.py [--model smollm2-135m-instruct] [--old-slots 8]
        [--old-max-len 2048] [--old-dtype bfloat16] [--kv-cache-dtype int8] [--max-running 64]
        [--num-requests 128] [--input-len uniform:50,1500] [--output-len uniform:20,200]
        [--result-dir out/bench_kv_capacity]

The slot cache reserved --old-slots x --old-max-len positions (8 x 2048 by default), so it never ran more
than --old-slots requests at once. This script gives the paged cache exactly those bytes
(old slots x old max len x bytes per position: layers x KV heads x head dim x 2 (K, V) x the cache dtype's
size; SmolLM2 in bfloat16: 30 x 3 x 64 x 2 x 2 = 23,040 bytes, 377,487,360 bytes in all; --old-dtype
sets that size, --kv-cache-dtype the paged cache's, so int8 pages show what those bytes hold), starts
`jaxinfer serve --kv-cache-memory <bytes> --max-running 64 --max-len 2048` and sends a mixed workload all
at once with `jaxinfer bench-serving` (prompt and output lengths uniform, ignore_eos, greedy), sampling
`jaxinfer_running_requests` (and the KV pages in use) from the metrics endpoint every --interval seconds.
Prints the peak and mean number of requests running at once (the mean over the run, from the first
sample with a request running to the last), failed requests (should be 0), preemptions, and the peak
and mean against --old-slots. The defaults run about 3 minutes on 2 cores once the server is up.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from bench_prefix_caching import Server, add_run_args, bench_serving, prepare_run, scrape_metrics

from jaxinfer.cpu_kernels.native_build import cpu_description


def bytes_per_position(model: str, cache_dtype: str) -> tuple[int, str]:
    """KV bytes of one position over every layer, and how they were computed."""
    from jaxinfer.kv_cache import bytes_per_page
    from jaxinfer.loading import config_from_gguf, config_from_hf
    from jaxinfer.registry import resolve_model

    kind, path = resolve_model(model)
    if kind == "gguf":
        config = config_from_gguf(path)
    elif kind == "hf":
        config = config_from_hf(json.loads((Path(path) / "config.json").read_text()))
    else:
        raise SystemExit(f"--model {model}: only GGUF and Hugging Face folders are read here ({kind})")
    per_position = bytes_per_page(config, 1, cache_dtype)
    how = (
        f"{config.num_layers} layers x {config.num_kv_heads} KV heads x {config.head_dim} dims x 2 (K, V) "
        f"x {cache_dtype}"
    )
    return per_position, how


class Sampler(threading.Thread):
    """Scrapes the metrics endpoint every interval_s: (seconds, running, KV pages used, queue depth)."""

    def __init__(self, metrics_port: int, interval_s: float):
        super().__init__(name="metrics-sampler", daemon=True)
        self.metrics_port, self.interval_s = metrics_port, interval_s
        self.samples: list[tuple[float, float, float, float]] = []
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        start = time.perf_counter()
        while not self._halt.is_set():
            tick = time.perf_counter()
            try:
                m = scrape_metrics(self.metrics_port)
                self.samples.append(
                    (
                        tick - start,
                        m.get("jaxinfer_running_requests", 0.0),
                        m.get("jaxinfer_kv_pages_used", 0.0),
                        m.get("jaxinfer_queue_depth", 0.0),
                    )
                )
            except OSError:
                self.errors += 1
            self._halt.wait(max(0.0, self.interval_s - (time.perf_counter() - tick)))

    def stop(self) -> None:
        self._halt.set()
        self.join()


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--old-slots", type=int, default=8, help="the slot cache's slots")
    parser.add_argument("--old-max-len", type=int, default=2048, help="the slot cache's positions per slot")
    parser.add_argument(
        "--old-dtype", default="bfloat16", help="the slot cache's dtype, which sets the memory (CPU default)"
    )
    parser.add_argument(
        "--kv-cache-dtype", default=None, help="the paged cache's dtype (default: --old-dtype)"
    )
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--input-len", default="uniform:50,1500", help="bench-serving length distribution")
    parser.add_argument("--output-len", default="uniform:20,200", help="bench-serving length distribution")
    parser.add_argument("--request-rate", default="inf", help="arrivals/s (inf: all at once)")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between metrics samples")
    add_run_args(parser, "out/bench_kv_capacity")
    args = parser.parse_args()
    jaxinfer, result_dir = prepare_run(args)
    args.kv_cache_dtype = args.kv_cache_dtype or args.old_dtype
    per_position, how = bytes_per_position(args.model, args.old_dtype)
    kv_bytes = args.old_slots * args.old_max_len * per_position
    print(
        f"{args.model}: {per_position} bytes per position ({how}); the slot cache's "
        f"{args.old_slots} x {args.old_max_len} positions = {kv_bytes} bytes ({kv_bytes / 2**20:.1f} MiB), "
        f"paged as {args.kv_cache_dtype}"
    )
    serve_flags = [
        "--model", args.model, "--kv-cache-memory", str(kv_bytes), "--kv-cache-dtype", args.kv_cache_dtype,
        "--max-running", str(args.max_running), "--max-len", str(args.max_len),
        "--max-queue", str(max(64, 2 * args.num_requests)),
    ]  # fmt: skip
    bench_flags = [
        "--num-prompts", str(args.num_requests), "--input-len", args.input_len,
        "--output-len", args.output_len, "--request-rate", args.request_rate, "--timeout", str(args.timeout),
    ]  # fmt: skip
    with Server(jaxinfer, serve_flags, result_dir / "server.log") as server:
        before = scrape_metrics(server.metrics_port)
        sampler = Sampler(server.metrics_port, args.interval)
        sampler.start()
        try:
            run = bench_serving(
                jaxinfer, server, bench_flags, result_dir / "bench.json", timeout_s=args.timeout + 60
            )
        finally:
            sampler.stop()
        after = scrape_metrics(server.metrics_port)

    samples = sampler.samples
    active = [i for i, s in enumerate(samples) if s[1] > 0]
    window = samples[active[0] : active[-1] + 1] if active else []
    running = [s[1] for s in window] or [0.0]
    pages = [s[2] for s in window] or [0.0]
    peak, mean = max(running), sum(running) / len(running)
    pages_total = after.get("jaxinfer_kv_pages_total", 0.0)
    preemptions = after.get("jaxinfer_preemptions_total", 0.0) - before.get("jaxinfer_preemptions_total", 0.0)
    span = window[-1][0] - window[0][0] if window else 0.0

    print(
        f"\n{args.num_requests} requests (input {args.input_len}, output {args.output_len}, rate "
        f"{args.request_rate}), --kv-cache-memory {kv_bytes} --max-running {args.max_running} "
        f"--max-len {args.max_len}: {pages_total:.0f} usable KV pages"
    )
    errors = f" {run['errors']}" if run["errors"] else ""
    print(
        f"completed {run['completed']}, failed {run['failed']}{errors}, preemptions "
        f"{preemptions:.0f}, duration {run['duration_s']:.1f}s, output {run['output_throughput']:.1f} tok/s, "
        f"total {run['total_token_throughput']:.1f} tok/s, TTFT p50 / p99 {run['ttft_ms']['p50']:.0f} / "
        f"{run['ttft_ms']['p99']:.0f} ms"
    )
    print(
        f"running requests over {len(window)} samples ({span:.1f}s, every {args.interval}s; "
        f"{sampler.errors} failed scrapes): peak {peak:.0f}, mean {mean:.1f}"
    )
    print(f"KV pages in use: peak {max(pages):.0f} / {pages_total:.0f}, mean {sum(pages) / len(pages):.1f}")
    print(
        f"against the slot cache's {args.old_slots} requests: peak {peak / args.old_slots:.2f}x, "
        f"mean {mean / args.old_slots:.2f}x"
    )
    summary = {
        "args": vars(args),
        "cpu": cpu_description(),
        "kv_cache_memory_bytes": kv_bytes,
        "bytes_per_position": per_position,
        "kv_pages_total": pages_total,
        "peak_running": peak,
        "mean_running": mean,
        "peak_over_old_slots": peak / args.old_slots,
        "mean_over_old_slots": mean / args.old_slots,
        "peak_kv_pages_used": max(pages),
        "preemptions": preemptions,
        "server_start_s": server.start_s,
        "run": {k: v for k, v in run.items() if k != "requests"},
        "samples": [list(s) for s in samples],  # seconds, running, KV pages used, queue depth
    }
    path = result_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {path}")
    if run["failed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
