"""Benchmark each Pallas kernel next to its plain-XLA reference, in the same run.

Prints, per kernel and shape: median time, achieved GB/s (memory-bound kernels) or TFLOP/s (prefill),
and the fraction of the HBM roofline (`--roofline-gbs`, default 4800 on an H200 / other GPU, 33 on this
CPU). On CPU the Pallas kernels run in interpret mode, so their numbers only show that the path works;
use `--small` (the CPU default) for shapes that finish in seconds.

    python scripts/bench_kernels.py               # GPU: realistic shapes; CPU: tiny shapes, interpret mode
    python scripts/bench_kernels.py --kernels decode --iters 50
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels import (  # noqa: E402
    decode_attention,
    decode_attention_reference,
    default_interpret,
    flash_attention,
    flash_attention_reference,
    int8_matmul,
    int8_matmul_reference,
    quantize_int8,
)

CPU_ROOFLINE_GBS = 33.0  # measured on the 2-core dev machine (see shared notes)
H200_ROOFLINE_GBS = 4800.0


def detect_roofline_gbs() -> float:
    """HBM bandwidth of the first device: 4800 GB/s for an H200 (and, lacking a table, other GPUs)."""
    device = jax.devices()[0]
    if device.platform == "gpu":
        return H200_ROOFLINE_GBS
    return CPU_ROOFLINE_GBS


def median_seconds(fn: Callable, *args, iters: int, warmup: int = 2) -> float:
    """Median wall time of fn(*args) over `iters` runs after `warmup` (compile) runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark: a kernel and its reference on the same arguments, with its byte / flop counts."""

    kernel: str
    shape: str
    pallas_fn: Callable
    reference_fn: Callable
    args: tuple
    bytes_moved: float
    flops: float
    compute_bound: bool = False


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def flash_cases(small: bool, interpret: bool) -> list[Case]:
    # (batch, heads, kv_heads, seq, dim)
    shapes = (
        [(1, 4, 2, 100, 64)]
        if small
        else [(4, 32, 8, 2048, 128), (1, 32, 8, 8192, 128), (2, 8, 4, 4096, 256)]
    )
    cases = []
    for batch, heads, kv_heads, seq, dim in shapes:
        kq, kk, kv = jax.random.split(jax.random.key(seq), 3)
        q = _normal(kq, (batch, heads, seq, dim), jnp.bfloat16)
        k = _normal(kk, (batch, kv_heads, seq, dim), jnp.bfloat16)
        v = _normal(kv, (batch, kv_heads, seq, dim), jnp.bfloat16)
        tables = dict(q_offsets=jnp.zeros((batch,), jnp.int32), kv_lengths=jnp.full((batch,), seq, jnp.int32))
        kwargs = dict(sm_scale=dim**-0.5, causal=True, **tables)
        pallas = jax.jit(lambda q, k, v, kw=kwargs: flash_attention(q, k, v, interpret=interpret, **kw))
        reference = jax.jit(lambda q, k, v, kw=kwargs: flash_attention_reference(q, k, v, **kw))
        causal_flops = 4 * batch * heads * seq * seq * dim / 2
        cases.append(
            Case(
                "flash_attention",
                f"B{batch} N{heads} K{kv_heads} T{seq} D{dim} causal bf16",
                pallas,
                reference,
                (q, k, v),
                2 * q.nbytes + k.nbytes + v.nbytes,
                causal_flops,
                compute_bound=True,
            )
        )
    return cases


def decode_cases(small: bool, interpret: bool) -> list[Case]:
    # (layers, slots, heads, kv_heads, max_len, dim, context, splits)
    shapes = (
        [(2, 4, 8, 2, 128, 64, 100, 2)]
        if small
        else [
            (4, 8, 32, 8, 4096, 128, 2048, 1),
            (4, 8, 32, 8, 4096, 128, 2048, 4),
            (4, 64, 32, 8, 4096, 128, 1024, 2),
            (4, 1, 32, 8, 32768, 128, 30000, 16),
        ]
    )
    cases = []
    for layers, slots, heads, kv_heads, max_len, dim, context, splits in shapes:
        kq, kk, kv, kl = jax.random.split(jax.random.key(max_len + slots), 4)
        q = _normal(kq, (slots, heads, dim), jnp.bfloat16)
        k_cache = _normal(kk, (layers, slots, kv_heads, max_len, dim), jnp.bfloat16)
        v_cache = _normal(kv, (layers, slots, kv_heads, max_len, dim), jnp.bfloat16)
        # Ragged lengths averaging `context`.
        lengths = jax.random.randint(kl, (slots,), context // 2, min(max_len, 3 * context // 2) + 1)
        lengths = lengths.at[0].set(context).astype(jnp.int32)
        kwargs = dict(layer=layers - 1, sm_scale=dim**-0.5, num_splits=splits)
        pallas = jax.jit(lambda *a, kw=kwargs: decode_attention(*a, interpret=interpret, **kw))
        reference = jax.jit(lambda *a, kw=kwargs: decode_attention_reference(*a, **kw))
        kv_bytes = 2 * int(lengths.sum()) * kv_heads * dim * 2
        cases.append(
            Case(
                "decode_attention",
                f"slots{slots} N{heads} K{kv_heads} ctx~{context} M{max_len} splits{splits} bf16",
                pallas,
                reference,
                (q, k_cache, v_cache, lengths),
                kv_bytes + 2 * q.nbytes,
                4 * int(lengths.sum()) * heads * dim,
            )
        )
    return cases


def int8_cases(small: bool, interpret: bool) -> list[Case]:
    # (m, n, k, group_size)
    shapes = (
        [(4, 256, 512, None), (4, 256, 512, 128)]
        if small
        else [
            (1, 4096, 4096, None),
            (8, 14336, 4096, None),
            (8, 4096, 14336, None),
            (8, 14336, 4096, 128),
            (64, 4096, 4096, None),
        ]
    )
    cases = []
    for m, n, k, group in shapes:
        kx, kw = jax.random.split(jax.random.key(n + k + m))
        x = _normal(kx, (m, k), jnp.bfloat16)
        w_q, scale = quantize_int8(_normal(kw, (n, k), jnp.float32), group_size=group)
        pallas = jax.jit(lambda x, w, s: int8_matmul(x, w, s, interpret=interpret))
        reference = jax.jit(int8_matmul_reference)
        scheme = "per-channel" if group is None else f"group{group}"
        cases.append(
            Case(
                "int8_matmul",
                f"m{m} n{n} k{k} {scheme} bf16",
                pallas,
                reference,
                (x, w_q, scale),
                w_q.nbytes + scale.nbytes + x.nbytes + m * n * 2,
                2 * m * n * k,
            )
        )
    return cases


def run_case(case: Case, iters: int, roofline_gbs: float) -> dict:
    out = case.pallas_fn(*case.args)
    ref = case.reference_fn(*case.args)
    row = {"kernel": case.kernel, "shape": case.shape, "rel_err": rel_err(out, ref)}
    for name, fn in (("pallas", case.pallas_fn), ("xla", case.reference_fn)):
        seconds = median_seconds(fn, *case.args, iters=iters)
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_gbs"] = case.bytes_moved / seconds / 1e9
        row[f"{name}_tflops"] = case.flops / seconds / 1e12
    row["roofline_ms"] = case.bytes_moved / (roofline_gbs * 1e9) * 1e3
    row["compute_bound"] = case.compute_bound
    return row


def format_row(row: dict, roofline_gbs: float) -> str:
    if row["compute_bound"]:
        rate = f"pallas {row['pallas_tflops']:7.1f} TFLOP/s  xla {row['xla_tflops']:7.1f} TFLOP/s"
    else:
        roof = 100 * row["pallas_gbs"] / roofline_gbs
        rate = f"pallas {row['pallas_gbs']:7.1f} GB/s ({roof:5.1f}% roof)  xla {row['xla_gbs']:7.1f} GB/s"
    times = f"pallas {row['pallas_ms']:9.3f} ms  xla {row['xla_ms']:9.3f} ms"
    return f"{row['kernel']:17s} {row['shape']:50s} {times}  {rate}  err {row['rel_err']:.1e}"


CASE_BUILDERS = {"flash": flash_cases, "decode": decode_cases, "int8": int8_cases}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--roofline-gbs", type=float, default=None, help="HBM GB/s (default: detect)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per case (default 30 GPU, 3 CPU)")
    parser.add_argument("--kernels", nargs="+", choices=list(CASE_BUILDERS), default=list(CASE_BUILDERS))
    parser.add_argument("--small", action="store_true", help="tiny shapes (default on CPU)")
    args = parser.parse_args(argv)

    interpret = default_interpret()
    small = args.small or interpret
    roofline_gbs = args.roofline_gbs or detect_roofline_gbs()
    iters = args.iters or (3 if interpret else 30)
    print(
        f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} interpret={interpret} "
        f"roofline={roofline_gbs:.0f} GB/s iters={iters}"
    )
    for name in args.kernels:
        for case in CASE_BUILDERS[name](small, interpret):
            print(format_row(run_case(case, iters, roofline_gbs), roofline_gbs), flush=True)


if __name__ == "__main__":
    main()
