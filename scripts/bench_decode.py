"""Prefill and decode speed of the embedded models, next to transformers measured in the same run.

    .venv/bin/python scripts/bench_decode.py [--models smollm2-135m-instruct gemma3-270m] [--batches 1 8]

Prints tokens/s for prefill (one prompt) and decode (batch 1 and 8, aggregate), the ratio to transformers
(float32, CPU, KV cache on), and the fraction of the memory-bandwidth roofline decode reaches: every step
must read all weights once plus the KV cache it attends over, and the bandwidth is measured in this run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine import PrefillChunk
from jaxinfer.request import SamplingParams
from jaxinfer.runtime import RuntimeOptions, build_runtime


def measure_bandwidth_gbs(megabytes: int = 512) -> float:
    """Read bandwidth of a large reduction, the bound decode cannot beat."""
    x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        total(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return x.nbytes / min(times) / 1e9


def param_bytes(params) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(params))


def bench_ours(name: str, prompt: list[int], batches: list[int], steps: int, quantize: str) -> dict:
    options = RuntimeOptions(model=name, num_slots=max(batches), max_len=512, quantize=quantize)
    runtime = build_runtime(options)
    engine, config = runtime.engine, runtime.config
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)

    def prefill(slot: int) -> None:
        engine.prefill([PrefillChunk(slot, prompt, 0, greedy, True, prompt)]).result()

    prefill(0)  # compile
    times = []
    for _ in range(3):
        start = time.perf_counter()
        prefill(0)
        times.append(time.perf_counter() - start)
    result = {"prefill": len(prompt) / statistics.median(times)}
    for batch in batches:
        for slot in range(engine.num_slots):
            engine.release(slot)
        for slot in range(batch):
            prefill(slot)
        engine.decode().result()  # compile this attend bucket
        start = time.perf_counter()
        pending = engine.decode()
        for _ in range(steps - 1):
            following = engine.decode()
            pending.result()
            pending = following
        pending.result()
        result[f"decode{batch}"] = batch * steps / (time.perf_counter() - start)
    attend = len(prompt) + steps  # the bucket covers at least this many positions
    kv_bytes_per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * attend * 4
    result["step_bytes"] = {b: param_bytes(runtime.model.params) + b * kv_bytes_per_slot for b in batches}
    result["path"] = runtime.model.path
    return result


def bench_transformers(path, prompt: list[int], batches: list[int], steps: int) -> dict:
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt])
    result = {}
    with torch.inference_mode():
        model(ids)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
        result["prefill"] = len(prompt) / statistics.median(times)
        for batch in batches:
            out = model(ids.repeat(batch, 1), use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(steps):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            result[f"decode{batch}"] = batch * steps / (time.perf_counter() - start)
    return result


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--quantize", default="none", choices=["none", "int8"])
    parser.add_argument("--no-transformers", action="store_true")
    args = parser.parse_args()

    bandwidth = measure_bandwidth_gbs()
    print(f"backend {jax.default_backend()}, weights {args.quantize}, read bandwidth {bandwidth:.1f} GB/s")
    prompt = list(np.random.default_rng(0).integers(100, 5000, size=args.prompt_len))
    rows = []
    for name in args.models:
        ours = bench_ours(name, prompt, args.batches, args.steps, args.quantize)
        ref = {}
        if not args.no_transformers:
            ref = bench_transformers(ours["path"], prompt, args.batches, args.steps)
        rows.append((name, f"prefill {args.prompt_len}", ours["prefill"], ref.get("prefill"), None))
        for b in args.batches:
            roofline = b * bandwidth * 1e9 / ours["step_bytes"][b]
            key = f"decode{b}"
            rows.append((name, f"decode batch {b}", ours[key], ref.get(key), ours[key] / roofline))

    header = f"{'model':<24}{'metric':<18}{'jaxinfer tok/s':>16}{'transformers':>14}"
    header += f"{'ratio':>8}{'roofline':>10}"
    print("\n" + header)
    for name, metric, ours_tps, ref_tps, frac in rows:
        ref_text = f"{ref_tps:14.1f}" if ref_tps else f"{'-':>14}"
        ratio = f"{ours_tps / ref_tps:7.2f}x" if ref_tps else f"{'-':>8}"
        frac_text = f"{frac:9.0%}" if frac is not None else f"{'-':>10}"
        print(f"{name:<24}{metric:<18}{ours_tps:16.1f}{ref_text}{ratio}{frac_text}")


if __name__ == "__main__":
    main()
