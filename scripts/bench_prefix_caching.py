"""Prefix caching on and off, through the gRPC server, in one run.

    .venv/bin/python scripts/bench_prefix_caching.py [--model smollm2-135m-instruct] [--num-requests 32]
        [--shared-prefix-len 2000] [--question-len 30] [--output-len 64] [--max-running 32]
        [--kv-cache-memory 2GiB] [--result-dir out/bench_prefix_caching]

Starts `jaxinfer serve` (the venv's) twice with the same flags, once with `--no-prefix-caching`, and drives
each with `jaxinfer bench-serving`: --num-requests requests sent at once (max concurrency = the number of
requests), every prompt one shared random document of --shared-prefix-len tokens plus its own
--question-len-token question, --output-len output tokens each (ignore_eos, greedy), no warm-up requests
(the server compiles everything at start), so the cached run starts with an empty prefix cache. Prints
TTFT p50/p99, output and total token throughput of both runs and their ratios, the prefix-cache hit rate
(hit / queried prompt tokens, scraped from the metrics endpoint after each run) and preemptions. The KV
pool (--kv-cache-memory) is the same for both and by default holds every request at full length
without sharing, so the uncached run is not slowed by preemption. Server logs and bench-serving result
files go to --result-dir.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from jaxinfer.cpu_kernels.native_build import cpu_description


def jaxinfer_command() -> list[str]:
    """The venv's `jaxinfer` console script, beside this interpreter."""
    script = Path(sys.executable).parent / "jaxinfer"
    return [str(script)] if script.exists() else [sys.executable, "-m", "jaxinfer.cli"]


def add_run_args(parser: argparse.ArgumentParser, result_dir: str) -> None:
    """The flags every server benchmark here takes: bench-serving's timeout, where results go, and
    the command that runs jaxinfer."""
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for each bench-serving run")
    parser.add_argument("--result-dir", default=result_dir)
    parser.add_argument("--jaxinfer", default=None, help="command that runs jaxinfer (default: the venv's)")


def prepare_run(args: argparse.Namespace) -> tuple[list[str], Path]:
    """-> (the jaxinfer command, the result folder, made); prints the CPU the run measures."""
    jaxinfer = shlex.split(args.jaxinfer) if args.jaxinfer else jaxinfer_command()
    result_dir = Path(args.result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    print(cpu_description())
    return jaxinfer, result_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(port: int) -> dict[str, float]:
    """Unlabelled samples of the Prometheus endpoint: name -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


class Server:
    """`jaxinfer serve` in a child process on free ports, its output in log_path; a context manager that
    waits until the gRPC port answers and stops the process (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self, jaxinfer: list[str], flags: list[str], log_path: Path, *, ready_timeout_s: float = 1200.0
    ):
        self.port, self.metrics_port = free_port(), free_port()
        self.command = [
            *jaxinfer, "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), *flags,
        ]  # fmt: skip
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None
        self.start_s = 0.0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> Server:
        print("$ " + " ".join(self.command), flush=True)
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        start = time.perf_counter()
        try:
            self._wait_ready(start)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.start_s = time.perf_counter() - start
        print(f"server up in {self.start_s:.1f}s (pid {self.process.pid}, log {self.log_path})", flush=True)
        return self

    def _wait_ready(self, start: float) -> None:
        import grpc

        from jaxinfer.client import InferenceClient

        while True:
            self.check_alive()
            if time.perf_counter() - start > self.ready_timeout_s:
                raise RuntimeError(f"server not ready after {self.ready_timeout_s:.0f}s; see {self.log_path}")
            with InferenceClient(self.target, timeout_s=5) as client:
                try:
                    grpc.channel_ready_future(client._channel).result(timeout=2)
                    client.model_info()
                    return
                except (grpc.FutureTimeoutError, grpc.RpcError):
                    time.sleep(1.0)

    def check_alive(self) -> None:
        """Raises RuntimeError with the end of the log if the server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"the server exited with status {self.process.returncode}: {' '.join(self.command)}\n"
                f"--- last lines of {self.log_path} ---\n{self.log_tail()}"
            )

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def bench_serving(
    jaxinfer: list[str], server: Server, flags: list[str], result_file: Path, *, timeout_s: float
) -> dict:
    """Runs `jaxinfer bench-serving` against the server; returns its single run's result."""
    command = [
        *jaxinfer, "bench-serving", "--target", server.target, "--result-file", str(result_file),
        "--warmup-requests", "0", "--ignore-eos", "--temperature", "0", *flags,
    ]  # fmt: skip
    print("$ " + " ".join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    print(done.stdout, end="", flush=True)
    server.check_alive()
    if done.returncode != 0 or not result_file.exists():
        raise RuntimeError(
            f"bench-serving exited with status {done.returncode}:\n{done.stderr[-4000:]}\n"
            f"--- server log ---\n{server.log_tail()}"
        )
    [run] = json.loads(result_file.read_text())["runs"]
    return run


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--shared-prefix-len", type=int, default=2000)
    parser.add_argument("--question-len", type=int, default=30)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="2GiB", help="the same KV page pool for both servers")
    add_run_args(parser, "out/bench_prefix_caching")
    args = parser.parse_args()
    jaxinfer, result_dir = prepare_run(args)
    serve_flags = [
        "--model", args.model, "--max-running", str(args.max_running),
        "--kv-cache-memory", args.kv_cache_memory, "--max-queue", str(max(64, 2 * args.num_requests)),
    ]  # fmt: skip
    bench_flags = [
        "--num-prompts", str(args.num_requests), "--shared-prefix-len", str(args.shared_prefix_len),
        "--input-len", str(args.question_len), "--output-len", str(args.output_len),
        "--max-concurrency", str(args.num_requests), "--timeout", str(args.timeout),
    ]  # fmt: skip
    runs = {}
    for name, extra in (("cached", []), ("uncached", ["--no-prefix-caching"])):
        print(f"\n=== prefix caching {'on' if not extra else 'off'} ===", flush=True)
        with Server(jaxinfer, serve_flags + extra, result_dir / f"server_{name}.log") as server:
            before = scrape_metrics(server.metrics_port)
            run = bench_serving(
                jaxinfer, server, bench_flags, result_dir / f"{name}.json", timeout_s=args.timeout + 60
            )
            after = scrape_metrics(server.metrics_port)

        def grown(metric: str, before=before, after=after) -> float:
            return after.get(metric, 0.0) - before.get(metric, 0.0)

        run["prefix_query_tokens"] = grown("jaxinfer_prefix_cache_queries_tokens_total")
        run["prefix_hit_tokens"] = grown("jaxinfer_prefix_cache_hits_tokens_total")
        run["preemptions"] = grown("jaxinfer_preemptions_total")
        run["kv_pages_total"] = after.get("jaxinfer_kv_pages_total")
        run["server_start_s"] = server.start_s
        runs[name] = run

    print(
        f"\n{args.model}: {args.num_requests} requests at once, {args.shared_prefix_len}-token shared "
        f"document + {args.question_len}-token question, {args.output_len} output tokens, --max-running "
        f"{args.max_running}, --kv-cache-memory {args.kv_cache_memory}"
    )
    header = f"{'prefix caching':<16}{'completed':>10}{'failed':>8}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"
    print(
        header + f"{'output tok/s':>14}{'total tok/s':>13}{'duration s':>12}{'hit rate':>10}{'preempted':>11}"
    )
    for name, run in runs.items():
        queries = run["prefix_query_tokens"]
        hit_rate = f"{run['prefix_hit_tokens'] / queries:.1%}" if queries else "-"
        print(
            f"{'on' if name == 'cached' else 'off':<16}{run['completed']:>10}{run['failed']:>8}"
            f"{run['ttft_ms']['p50']:13.0f}{run['ttft_ms']['p99']:13.0f}{run['output_throughput']:14.1f}"
            f"{run['total_token_throughput']:13.1f}{run['duration_s']:12.1f}{hit_rate:>10}"
            f"{run['preemptions']:>11.0f}"
        )
    on, off = runs["cached"], runs["uncached"]
    hits, queries = on["prefix_hit_tokens"], on["prefix_query_tokens"]
    print(
        f"prefix cache (on): {hits:.0f} hit / {queries:.0f} queried prompt tokens "
        f"= {hits / max(queries, 1):.1%} hit rate"
    )
    ttft_p50, ttft_p99 = (off["ttft_ms"][k] / on["ttft_ms"][k] for k in ("p50", "p99"))
    print(f"TTFT p50 off/on: {ttft_p50:.2f}x, TTFT p99 off/on: {ttft_p99:.2f}x")
    output, total = (on[k] / off[k] for k in ("output_throughput", "total_token_throughput"))
    print(f"output throughput on/off: {output:.2f}x, total throughput on/off: {total:.2f}x")
    summary = result_dir / "summary.json"
    document = {
        "args": vars(args),
        "cpu": cpu_description(),
        "runs": {name: {k: v for k, v in run.items() if k != "requests"} for name, run in runs.items()},
        "ratios": {
            "ttft_p50_off_on": ttft_p50,
            "ttft_p99_off_on": ttft_p99,
            "output_on_off": output,
            "total_on_off": total,
        },
    }
    summary.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {summary}")
    if on["failed"] or off["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
