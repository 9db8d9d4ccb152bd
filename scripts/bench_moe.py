"""Decode step of a mixture-of-experts model against the dense model with the same active parameters.

Two random models of one stated shape, run by the engine with the backend's kernels (on CPU: the native
grouped matmul for the experts, the native int8 matmul and decode attention elsewhere):

  moe    every layer's MLP is --experts experts of --expert-inter, --top-k of them per token
  dense  every layer's MLP is one gated MLP of top_k * expert_inter (the MoE's active MLP parameters)

Both decode --batches streams after a --prompt-len prompt, alternately (moe, dense, moe, dense, ...) so the
machine's noise falls on both; prints the median tok/s and ms per step, the ratio moe / dense of the step
time, and the weight bytes each step reads (the MoE reads every expert that received a token: at 16
streams and top-2 of 8, nearly all of them).

    .venv/bin/python scripts/bench_moe.py [--quantize none|int8] [--batches 1 16] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.cpu_kernels.native_build import cpu_description
from jaxinfer.engine import DecodeBatch, PrefillChunk
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.kv_cache import contiguous_page_table
from jaxinfer.models.params import random_params
from jaxinfer.quantization import quantize_params
from jaxinfer.request import SamplingParams
from jaxinfer.runtime import add_kernel_forms


def configs(args) -> tuple[ModelConfig, ModelConfig]:
    moe = ModelConfig(
        arch="mixtral", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.expert_inter,
        num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 256, head_dim=64,
        max_position_embeddings=4096, tie_word_embeddings=True, num_experts=args.experts,
        experts_per_token=args.top_k, expert_intermediate_size=args.expert_inter,
    )  # fmt: skip
    dense = dataclasses.replace(
        moe, arch="llama", intermediate_size=args.top_k * args.expert_inter, num_experts=0,
        experts_per_token=0, expert_intermediate_size=0,
    )  # fmt: skip
    return moe, dense


def engine_for(config: ModelConfig, batch: int, max_len: int, quantize: str) -> JaxEngine:
    kernels = KernelConfig.for_backend(jax.default_backend())
    params = add_kernel_forms(quantize_params(random_params(config, seed=1), quantize), kernels)
    page_size = 16
    cache = CacheConfig(
        num_pages=batch * (max_len // page_size) + 1, page_size=page_size, max_len=max_len, num_slots=batch,
        dtype="bfloat16",
    )  # fmt: skip
    return JaxEngine(params, config, cache, kernels=kernels)


def decode_rate(engine: JaxEngine, batch: int, prompt_len: int, steps: int) -> float:
    """Aggregate tok/s of `steps` decode steps over `batch` streams after a prompt each."""
    max_len = engine.cache_config.max_len
    table = contiguous_page_table(batch, max_len // engine.cache_config.page_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    prompt = list(np.random.default_rng(0).integers(0, engine.config.vocab_size, prompt_len))
    for slot in range(batch):
        chunk = PrefillChunk(slot, prompt, 0, greedy, table[slot].tolist(), True, prompt)
        engine.prefill([chunk]).result()
    start = time.perf_counter()
    pending = engine.decode(DecodeBatch(np.full(batch, prompt_len, np.int32), table))
    for step in range(1, steps):
        following = engine.decode(DecodeBatch(np.full(batch, prompt_len + step, np.int32), table))
        pending.result()
        pending = following
    pending.result()
    return batch * steps / (time.perf_counter() - start)


def weight_bytes(engine: JaxEngine, config: ModelConfig, batch: int) -> float:
    """Weight bytes a step reads: everything but the experts no token picked (expected count, uniform
    routing: experts * (1 - (1 - k / experts) ** batch))."""
    total = moe_part = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        total += leaf.nbytes
        if any(getattr(k, "key", None) in ("expert_gate", "expert_up", "expert_down") for k in path):
            moe_part += leaf.nbytes
    if not config.num_experts:
        return total
    touched = 1 - (1 - config.experts_per_token / config.num_experts) ** batch
    return total - moe_part * (1 - touched)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-inter", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--quantize", default="none", choices=("none", "int8"))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(cpu_description())
    moe, dense = configs(args)
    print(
        f"shape: hidden {args.hidden}, {args.layers} layers, {moe.num_heads} heads / {moe.num_kv_heads} KV "
        f"heads of 64, vocab {args.vocab} (tied); MoE {args.experts} experts x {args.expert_inter}, top-"
        f"{args.top_k}; dense MLP {dense.intermediate_size}; weights {args.quantize}, bf16 KV cache"
    )
    max_len = 1 << (args.prompt_len + args.steps).bit_length()
    header = ("batch", "moe tok/s", "dense tok/s", "moe ms", "dense ms", "moe/dense", "moe MB", "dense MB")
    print(" ".join(f"{h:>11}" for h in header))
    for batch in args.batches:
        engines = {
            name: engine_for(c, batch, max_len, args.quantize) for name, c in (("moe", moe), ("dense", dense))
        }
        for engine in engines.values():
            engine.warmup([args.prompt_len] * batch, max_new_tokens=args.steps + 1)
            decode_rate(engine, batch, args.prompt_len, 4)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                rates[name].append(decode_rate(engine, batch, args.prompt_len, args.steps))
        rate = {name: statistics.median(r) for name, r in rates.items()}
        ms = {name: 1000 * batch / r for name, r in rate.items()}
        mb = {
            name: weight_bytes(engines[name], c, batch) / 1e6 for name, c in (("moe", moe), ("dense", dense))
        }
        row = (batch, f"{rate['moe']:.1f}", f"{rate['dense']:.1f}", f"{ms['moe']:.2f}", f"{ms['dense']:.2f}")
        row += (f"{ms['moe'] / ms['dense']:.2f}x", f"{mb['moe']:.0f}", f"{mb['dense']:.0f}")
        print(" ".join(f"{v:>11}" for v in row))
        del engines


if __name__ == "__main__":
    main()
