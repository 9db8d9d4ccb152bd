"""Prefill and decode speed of the embedded models, next to transformers measured in the same run.

    .venv/bin/python scripts/bench_decode.py [--models smollm2-135m-instruct gemma3-270m]
        [--batches 1 4 8 16 32] [--prefill-len 512] [--prompt-len 128] [--quantize auto|int8|int4|none]
        [--kv-cache-dtype float32|bfloat16|int8] [--page-size N] [--repeats 3]
        [--llama-bench /path/to/llama-bench] [--rounds N]

Prints tokens/s for prefill (one prompt of --prefill-len tokens) and decode (each batch size, aggregate,
every stream after a --prompt-len prompt, the median of --repeats runs), the ratio to transformers
(float32, CPU, KV cache on), and the fraction of the memory-bandwidth roofline decode reaches: every step
must read all weights once plus the KV cache it attends over, and the bandwidth is measured in this run.
Each stream reads its KV cache through a page table of --page-size pages (default: the backend's).
With --rounds N, jaxinfer and llama.cpp are measured N times, alternating, and each ratio to llama.cpp is
the median of the N rounds' own ratios (a shared VM's speed drifts by 10-30% between runs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import CacheConfig
from jaxinfer.cpu_kernels.native_build import cpu_description
from jaxinfer.engine import DecodeBatch, PrefillChunk
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.kernel_dispatch import weight_read_bytes
from jaxinfer.kv_cache import contiguous_page_table
from jaxinfer.quantization import QUANTIZATION_MODES, quantization_of
from jaxinfer.request import SamplingParams
from jaxinfer.roofline import measure_bandwidth_gbs
from jaxinfer.runtime import RuntimeOptions, build_runtime


def step_weight_bytes(params, rows: int, kernels) -> int:
    """Weight bytes one decode step over `rows` rows must read once: each weight in the form its kernel
    reads at that many rows (kernel_dispatch.weight_read_bytes)."""
    top = [w for k, w in params.items() if k != "layers"]
    weights = top + [w for layer in params["layers"] for w in layer.values()]
    return sum(weight_read_bytes(w, rows, kernels) for w in weights)


def bench_ours(
    name: str,
    prompt: list[int],
    prefill_prompt: list[int],
    batch: int,
    steps: int,
    quantize: str,
    cache_dtype: str | None = None,
    repeats: int = 3,
    measure_prefill: bool = True,
    page_size: int | None = None,
) -> dict:
    """One batch size on an engine with exactly that many slots (a decode step computes every slot),
    each slot owning whole-context pages in order:
    {"path", "decode": aggregate tok/s, "step_bytes": bytes a step reads, "prefill": tok/s if measured}."""
    longest = max(len(prompt) + steps, len(prefill_prompt))
    max_len = 1 << (longest - 1).bit_length()  # a power of two that holds the requests
    runtime = build_runtime(
        RuntimeOptions(
            model=name, num_slots=1, max_len=max_len, quantize=quantize, cache_dtype=cache_dtype,
            page_size=page_size, kv_pages=1,
        )
    )  # fmt: skip
    params, config = runtime.engine.params, runtime.config
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    result: dict = {"path": str(runtime.model.path), "quantization": quantization_of(runtime.model.params)}
    cache_dtype = runtime.engine.cache_config.dtype  # given, or the CLI's default for this backend
    page_size = runtime.engine.page_size
    pages_per_slot = -(-max_len // page_size)
    cache = CacheConfig(
        num_pages=batch * pages_per_slot + 1, page_size=page_size, max_len=max_len, num_slots=batch,
        dtype=cache_dtype,
    )  # fmt: skip
    engine = JaxEngine(params, config, cache, mesh=runtime.engine.mesh, kernels=runtime.engine.kernels)
    table = contiguous_page_table(batch, pages_per_slot)

    def prefill(slot: int, tokens: list[int] = prompt) -> None:
        chunk = PrefillChunk(slot, tokens, 0, greedy, table[slot].tolist(), True, tokens)
        engine.prefill([chunk]).result()

    if measure_prefill:
        prefill(0, prefill_prompt)  # compile
        times = []
        for _ in range(3):
            start = time.perf_counter()
            prefill(0, prefill_prompt)
            times.append(time.perf_counter() - start)
        result["prefill"] = len(prefill_prompt) / statistics.median(times)
    # Every decode program the streams pass through (attend buckets, row bucket), compiled and run once
    # untimed.
    engine.warmup([len(prompt)] * batch, max_new_tokens=steps + 1)
    rates = []
    for _ in range(repeats):  # the median of a few runs: this shared VM varies 10-30% between runs
        for slot in range(batch):
            prefill(slot)
        # The host side of a step, as the scheduler does it: positions and the page table each step.
        start = time.perf_counter()
        pending = engine.decode(DecodeBatch(np.full(batch, len(prompt), np.int32), table))
        for step in range(1, steps):
            positions = np.full(batch, len(prompt) + step, np.int32)
            following = engine.decode(DecodeBatch(positions, table))
            pending.result()
            pending = following
        pending.result()
        rates.append(batch * steps / (time.perf_counter() - start))
    result["decode"] = statistics.median(rates)
    attend = engine.decode_attend_len(batch, len(prompt) + steps)  # the longest a stream reaches
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * attend
    kv_bytes *= jnp.dtype(cache_dtype).itemsize
    result["step_bytes"] = step_weight_bytes(params, batch, engine.kernels) + batch * kv_bytes
    return result


def bench_transformers(
    path, prompt: list[int], prefill_prompt: list[int], batches: list[int], steps: int
) -> dict:
    import torch
    import transformers

    torch.set_num_threads(2)
    path = pathlib.Path(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids, prefill_ids = torch.tensor([prompt]), torch.tensor([prefill_prompt])
    result = {}
    with torch.inference_mode():
        model(prefill_ids)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model(prefill_ids)
            times.append(time.perf_counter() - start)
        result["prefill"] = len(prefill_prompt) / statistics.median(times)
        for batch in batches:
            out = model(ids.repeat(batch, 1), use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(steps):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            result[f"decode{batch}"] = batch * steps / (time.perf_counter() - start)
    return result


def in_subprocess(function: str, *args) -> dict:
    """bench_decode.<function>(*args) in a fresh Python process (its printed JSON result). Each engine
    runs alone: XLA's CPU thread pool here would compete with transformers, and a batch size measured
    after others in one process ran up to ~20% slower on this machine."""
    code = (
        "import json, sys; sys.path.insert(0, 'scripts'); import bench_decode as b; "
        f"print(json.dumps(b.{function}(*json.loads(sys.argv[1]))))"
    )
    command = [sys.executable, "-c", code, json.dumps(args)]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def bench_llama_cpp(
    binary: str, path, prompt_len: int, prompt_ctx: int, steps: int, batches: list[int]
) -> dict:
    """llama.cpp on the same GGUF file, 2 threads: llama-bench for prefill and one-stream decode, and
    llama-batched-bench (beside it) for decode at several streams, each stream after a `prompt_ctx`-token
    prompt: {"prefill", "decode<batch>"} in tok/s."""
    cmd = [binary, "-m", str(path), "-p", str(prompt_len), "-n", str(steps), "-t", "2", "-o", "json"]
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    result = {}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            result["prefill"] = row["avg_ts"]
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            result["decode1"] = row["avg_ts"]
    several = [b for b in batches if b > 1]
    batched = pathlib.Path(binary).with_name("llama-batched-bench")
    if several and batched.exists():
        context = max(several) * (prompt_ctx + steps)
        cmd = [
            str(batched), "-m", str(path), "-c", str(context), "-b", "2048", "-ub", "512", "-t", "2",
            "-npp", str(prompt_ctx), "-ntg", str(steps), "-npl", ",".join(map(str, several)),
            "--output-format", "jsonl",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        for line in (done.stdout + done.stderr).splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                result[f"decode{row['pl']}"] = row["speed_tg"]
    return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--prefill-len", type=int, default=512, help="prompt tokens for the prefill figure")
    parser.add_argument("--prompt-len", type=int, default=128, help="context of each decode stream")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="decode runs per batch size (median)")
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="measure jaxinfer and llama.cpp this many times, alternating; report medians and the median "
        "of the per-round ratios (a shared VM's speed drifts between runs)",
    )  # fmt: skip
    parser.add_argument(
        "--quantize",
        default="auto",
        choices=["auto", *QUANTIZATION_MODES],
        help="the weights to time; auto: what `jaxinfer generate` serves for each model here",
    )
    parser.add_argument("--kv-cache-dtype", default=None, help="default: the CLI's (bfloat16 on CPU)")
    parser.add_argument("--page-size", type=int, default=None, help="default: the CLI's for this backend")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--llama-bench",
        default=None,
        help="path to llama.cpp's llama-bench (llama-batched-bench beside it times several streams)",
    )
    args = parser.parse_args()

    bandwidth = measure_bandwidth_gbs()
    print(cpu_description())
    cache = args.kv_cache_dtype or "default"
    print(
        f"backend {jax.default_backend()}, weights {args.quantize}, KV cache {cache}, "
        f"page size {args.page_size or 'default'}, read bandwidth {bandwidth:.1f} GB/s"
    )
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 5000, size=args.prompt_len)]
    prefill_prompt = [int(t) for t in rng.integers(100, 5000, size=args.prefill_len)]
    rows, spreads = [], []
    for name in args.models:
        rounds = []  # (ours: batch -> result, llama.cpp: metric -> tok/s), alternating
        for _ in range(args.rounds):
            ours = {  # batch size -> its result; prefill measured with the first
                batch: in_subprocess(
                    "bench_ours", name, prompt, prefill_prompt, batch, args.steps, args.quantize,
                    args.kv_cache_dtype, args.repeats, i == 0, args.page_size,
                )
                for i, batch in enumerate(args.batches)
            }  # fmt: skip
            first = ours[args.batches[0]]
            path, weights = first["path"], first["quantization"]
            lcpp = {}
            if args.llama_bench:
                lcpp = bench_llama_cpp(
                    args.llama_bench, path, args.prefill_len, args.prompt_len, args.steps, args.batches
                )
            rounds.append((ours, lcpp))
        ref = {}
        if not args.no_transformers:
            ref = in_subprocess("bench_transformers", path, prompt, prefill_prompt, args.batches, args.steps)
        metrics = [("prefill", f"prefill {args.prefill_len}", None)]
        metrics += [(f"decode{b}", f"decode batch {b}", b) for b in args.batches]
        for key, label, batch in metrics:
            if batch is None:  # prefill, measured with the first batch size
                mine = [ours[args.batches[0]]["prefill"] for ours, _ in rounds]
            else:
                mine = [ours[batch]["decode"] for ours, _ in rounds]
            theirs = [lcpp[key] for _, lcpp in rounds if key in lcpp]
            ratio = None
            if len(theirs) == len(mine):  # the median of the rounds' own ratios
                ratio = statistics.median(m / t for m, t in zip(mine, theirs))
                if args.rounds > 1:
                    each = " ".join(f"{m / t:.2f}" for m, t in zip(mine, theirs))
                    spreads.append(f"{name} {label}: llama.cpp ratio per round {each}")
            frac = None
            if batch is not None:
                step_bytes = statistics.median(ours[batch]["step_bytes"] for ours, _ in rounds)
                frac = statistics.median(mine) * step_bytes / (batch * bandwidth * 1e9)
            ours_tps = statistics.median(mine)
            lcpp_tps = statistics.median(theirs) if theirs else None
            rows.append((f"{name} {weights}", label, ours_tps, ref.get(key), lcpp_tps, ratio, frac))

    header = f"{'model, weights':<30}{'metric':<18}{'jaxinfer tok/s':>16}{'transformers':>14}{'ratio':>8}"
    header += f"{'llama.cpp':>11}{'ratio':>8}{'roofline':>10}"
    print("\n" + header)
    for name, metric, ours_tps, ref_tps, lcpp_tps, lcpp_ratio, frac in rows:
        line = f"{name:<30}{metric:<18}{ours_tps:16.1f}"
        ref_ratio = ours_tps / ref_tps if ref_tps else None
        for other, ratio, width in ((ref_tps, ref_ratio, 14), (lcpp_tps, lcpp_ratio, 11)):
            line += f"{other:{width}.1f}{ratio:7.2f}x" if other else f"{'-':>{width}}{'-':>8}"
        line += f"{frac:9.0%}" if frac is not None else f"{'-':>10}"
        print(line)
    if spreads:
        print(f"\n{args.rounds} rounds, jaxinfer then llama.cpp in each; the ratio column is their median:")
        print("\n".join(spreads))


if __name__ == "__main__":
    main()
