"""Time a Mixture-of-Experts MLP (jaxinfer.models.moe.moe_mlp) against a dense gated MLP with the same ACTIVE
parameters (intermediate = experts_per_token * expert intermediate), in one run on this CPU.

Variants, each one jitted call of one MLP block:
  moe native   moe_mlp through the C++ grouped matmul (reads only the experts that received tokens)
  moe xla      moe_mlp through lax.ragged_dot (XLA:CPU expands it densely over every expert)
  dense        silu(x @ Wg.T) * (x @ Wu.T) @ Wd.T, float32, intermediate k * expert_inter
  (--int8 / --int4: the native MoE over int8 / int4 experts too; int4 in groups of 32, the arithmetic
  float32 as for the other two)

The variants run alternately (A, B, C, A, B, C, ...) so that the machine's noise spreads over all of them;
the medians are reported, with the ratio MoE / dense and the weight bytes each call reads.

    .venv/bin/python scripts/bench_moe_mlp.py
    .venv/bin/python scripts/bench_moe_mlp.py --hidden 2048 --experts 16 --inter 768 --top-k 4 --int8 --int4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxinfer.config import KernelConfig  # noqa: E402
from jaxinfer.cpu_kernels.grouped_matmul import KERNEL, grouped_matmul_available  # noqa: E402
from jaxinfer.cpu_kernels.native_build import cpu_description  # noqa: E402
from jaxinfer.models.moe import moe_mlp, route  # noqa: E402
from jaxinfer.weight_formats import Int8Weight, quantize_int4  # noqa: E402


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--inter", type=int, default=1024, help="intermediate size of one expert")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--iters", type=int, default=30, help="timed calls per variant")
    parser.add_argument("--int8", action="store_true", help="also time the native MoE over int8 experts")
    parser.add_argument("--int4", action="store_true", help="also time the native MoE over int4 experts")
    args = parser.parse_args()
    hidden, experts, inter, k = args.hidden, args.experts, args.inter, args.top_k

    print(cpu_description())
    native = grouped_matmul_available()
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}; native grouped matmul: "
        + (f"{KERNEL.chosen_isa().name} variant" if native else "not available")
    )
    print(
        f"shape: hidden {hidden}, {experts} experts of intermediate {inter}, top-{k}, float32; "
        f"dense MLP with intermediate {k * inter} (same active parameters)"
    )

    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-1]), jnp.float32)

    router = normal(experts, hidden)
    gate, up, down = (
        normal(experts, inter, hidden),
        normal(experts, inter, hidden),
        normal(experts, hidden, inter),
    )
    dense = (normal(k * inter, hidden), normal(k * inter, hidden), normal(hidden, k * inter))

    def int8(w):
        scale = jnp.max(jnp.abs(w), axis=-1) / 127
        return Int8Weight(jnp.round(w / scale[..., None]).astype(jnp.int8), scale)

    def moe(matmul: str):
        kernels = KernelConfig(matmul=matmul)
        return jax.jit(
            lambda x, r, g, u, d: moe_mlp(
                x, r, g, u, d, experts_per_token=k, normalize=True, activation=swiglu, kernels=kernels
            )
        )

    dense_fn = jax.jit(lambda x, wg, wu, wd: swiglu(x @ wg.T, x @ wu.T) @ wd.T)
    expert_bytes = 3 * inter * hidden  # elements of one expert's three projections
    variants = {"dense f32": (dense_fn, dense)}
    if native:
        variants["moe native f32"] = (moe("native"), (router, gate, up, down))
    variants["moe xla ragged_dot f32"] = (moe("xla"), (router, gate, up, down))
    if native and args.int8:
        variants["moe native int8"] = (moe("native"), (router, int8(gate), int8(up), int8(down)))
    if native and args.int4:
        int4 = jax.jit(quantize_int4)
        variants["moe native int4"] = (moe("native"), (router, int4(gate), int4(up), int4(down)))

    for tokens in args.tokens:
        x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
        _, chosen = route(x @ router.T, k, True)
        active = len(np.unique(np.asarray(chosen)))
        read = {
            "dense f32": 3 * k * inter * hidden * 4,
            "moe native f32": active * expert_bytes * 4,
            "moe xla ragged_dot f32": experts * expert_bytes * 4,  # every expert, copied as well
            "moe native int8": active * expert_bytes * (1 + 4 / hidden),
            "moe native int4": active * expert_bytes * (0.5 + 8 / 32),  # scale and minimum per 32
        }
        for fn, weights in variants.values():  # compile and warm up
            for _ in range(3):
                jax.block_until_ready(fn(x, *weights))
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for i in range(args.iters):
            for name in names[i % len(names) :] + names[: i % len(names)]:  # rotate the order
                fn, weights = variants[name]
                start = time.perf_counter()
                jax.block_until_ready(fn(x, *weights))
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["dense f32"])
        print(f"\n{tokens} token(s): {active} of {experts} experts routed to; median of {args.iters} calls")
        print(f"  {'variant':<24} {'ms/call':>9} {'vs dense':>9} {'weight MB read':>15} {'GB/s':>7}")
        for name in names:
            t = statistics.median(times[name])
            mb = read[name] / 1e6
            print(f"  {name:<24} {t * 1e3:9.3f} {t / base:9.2f}x {mb:15.1f} {mb / 1e3 / t:7.1f}")


if __name__ == "__main__":
    main()
