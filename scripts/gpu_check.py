"""One-shot accelerator check of the Pallas kernels (run through scripts/gpu_check.sh on an NVIDIA GPU).

1. Errors: every kernel against its plain-JAX reference on random inputs (bf16 and f32, odd lengths, GQA,
   sliding window, softcap, ragged / inactive slots, split-K, per-channel and per-group int8).
2. Speed: each kernel next to the XLA reference path (median of many runs after warm-up), from
   scripts/bench_kernels.py.
3. Decode of a Llama-3-8B-shaped layer stack (hidden 4096, 32 heads / 8 kv heads of 128, MLP 14336) with
   random weights, bf16 and int8 weights, Pallas vs XLA attention / matmuls, against the HBM roofline:
   bytes per step = all weights + the valid K/V rows read, divided by `--roofline-gbs`.
Prints a short table last. A time budget (`--budget-s`, default 420) skips what would not fit.

    python scripts/gpu_check.py              # on the GPU machine
    python scripts/gpu_check.py --dry-run    # tiny shapes, any backend (interpret mode on CPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_kernels  # noqa: E402

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

TABLE: list[tuple[str, str, str]] = []  # (check, status, detail), printed last


def _record(check: str, ok: bool | None, detail: str) -> None:
    status = "ok" if ok else ("FAIL" if ok is False else "info")
    TABLE.append((check, status, detail))
    print(f"[{status}] {check}: {detail}", flush=True)


def _normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


# ----------------------------------------------------------------------------------------------------------
# 1. Errors against the references


def check_errors(dry_run: bool, interpret: bool) -> None:
    # On GPU, f32 dots may run as TF32 in both paths, so f32 gets a looser bound than on CPU.
    tolerance = {jnp.float32: 1e-5 if interpret else 5e-3, jnp.bfloat16: 1e-2}
    seq, max_len = (45, 64) if dry_run else (1000, 4096)
    for dtype in (jnp.bfloat16, jnp.float32):
        for heads, kv_heads, dim, window, softcap in (
            (8, 2, 64, None, None),
            (8, 1, 128, 33, None),
            (4, 4, 256, None, 50.0),
        ):
            kq, kk, kv = jax.random.split(jax.random.key(dim + heads), 3)
            q = _normal(kq, (2, heads, seq, dim), dtype)
            k = _normal(kk, (2, kv_heads, seq + 7, dim), dtype)
            v = _normal(kv, (2, kv_heads, seq + 7, dim), dtype)
            tables = dict(
                q_offsets=jnp.array([0, 7], jnp.int32), kv_lengths=jnp.array([seq, seq + 7], jnp.int32)
            )
            kwargs = dict(**tables, sm_scale=dim**-0.5, sliding_window=window, logit_softcap=softcap)
            out = flash_attention(q, k, v, interpret=interpret, **kwargs)
            err = bench_kernels.rel_err(out, flash_attention_reference(q, k, v, **kwargs))
            finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
            _record(
                f"flash N{heads}/K{kv_heads} D{dim} w{window} cap{softcap} {jnp.dtype(dtype).name}",
                finite and err < tolerance[dtype],
                f"rel err {err:.2e}",
            )

        for heads, kv_heads, dim, splits, window in (
            (32, 8, 128, 1, None),
            (32, 8, 128, 4, None),
            (8, 1, 256, 2, 40),
        ):
            kq, kk, kv = jax.random.split(jax.random.key(splits + dim), 3)
            slots = 5
            q = _normal(kq, (slots, heads, dim), dtype)
            k_cache = _normal(kk, (2, slots, kv_heads, max_len, dim), dtype)
            v_cache = _normal(kv, (2, slots, kv_heads, max_len, dim), dtype)
            lengths = jnp.array([0, 1, max_len // 3 + 5, max_len - 3, max_len], jnp.int32)
            kwargs = dict(layer=1, sm_scale=dim**-0.5, num_splits=splits, sliding_window=window)
            out = decode_attention(q, k_cache, v_cache, lengths, interpret=interpret, **kwargs)
            ref = decode_attention_reference(q, k_cache, v_cache, lengths, **kwargs)
            err = bench_kernels.rel_err(out, ref)
            ok = bool(jnp.isfinite(out.astype(jnp.float32)).all()) and bool((out[0] == 0).all())
            _record(
                f"decode N{heads}/K{kv_heads} D{dim} splits{splits} w{window} {jnp.dtype(dtype).name}",
                ok and err < tolerance[dtype],
                f"rel err {err:.2e}",
            )

        n, k = (256, 512) if dry_run else (4096, 4096)
        for m, group in ((1, None), (13, None), (16, 128), (130, 64)):
            kx, kw = jax.random.split(jax.random.key(m))
            x = _normal(kx, (m, k), dtype)
            w_q, scale = quantize_int8(_normal(kw, (n, k), jnp.float32), group_size=group)
            out = int8_matmul(x, w_q, scale, interpret=interpret)
            err = bench_kernels.rel_err(out, int8_matmul_reference(x, w_q, scale))
            finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
            _record(
                f"int8_matmul m{m} n{n} k{k} group{group} {jnp.dtype(dtype).name}",
                finite and err < tolerance[dtype],
                f"rel err {err:.2e}",
            )


# ----------------------------------------------------------------------------------------------------------
# 3. Llama-3-8B-shaped decode stack


@dataclasses.dataclass(frozen=True)
class StackConfig:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    layers: int = 8
    slots: int = 8
    max_len: int = 4096
    context: int = 2048
    # Split-K for the Pallas decode kernel: slots * kv_heads programs alone fill few of the 132 SMs.
    decode_splits: int = 4


def _init_stack(cfg: StackConfig, int8: bool):
    """Random weights, stored [out, in]; fused qkv and gate/up projections. int8: (w_q, per-channel scale)."""

    def weight(key, out_dim, in_dim):
        w = _normal(key, (out_dim, in_dim), jnp.bfloat16, scale=in_dim**-0.5)
        return quantize_int8(w) if int8 else w

    qkv_dim = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    layers = []
    for i in range(cfg.layers):
        k1, k2, k3, k4 = jax.random.split(jax.random.key(100 + i), 4)
        layers.append(
            {
                "wqkv": weight(k1, qkv_dim, cfg.hidden),
                "wo": weight(k2, cfg.hidden, cfg.heads * cfg.head_dim),
                "w_gate_up": weight(k3, 2 * cfg.ffn, cfg.hidden),
                "w_down": weight(k4, cfg.hidden, cfg.ffn),
            }
        )
    return layers


def _linear(x, w, mode: str, interpret: bool):
    """x [B, in] bf16 @ W.T, W [out, in]: bf16 array or (int8 [out, in], scale [out])."""
    if isinstance(w, tuple):
        w_q, scale = w
        if mode == "pallas":
            return int8_matmul(x, w_q, scale, interpret=interpret)
        # XLA's own weight-only int8 form: the int8 -> bf16 convert fuses into the dot.
        y = jax.lax.dot_general(
            x, w_q.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return (y * scale).astype(x.dtype)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def _rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype)


def _decode_step(layers, k_cache, v_cache, x, lengths, *, cfg: StackConfig, mode: str, interpret: bool):
    """One decode token per slot through every layer. x [B, hidden]; caches [L, B, K, M, D] (donated)."""
    batch = x.shape[0]
    positions = lengths - 1
    slot_ids = jnp.arange(batch)
    attention = decode_attention if mode == "pallas" else decode_attention_reference
    linear = functools.partial(_linear, mode=mode, interpret=interpret)
    q_dim, kv_dim = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i, w in enumerate(layers):
        qkv = linear(_rms_norm(x), w["wqkv"])  # [B, (N + 2K) * D]
        q = qkv[:, :q_dim].reshape(batch, cfg.heads, cfg.head_dim)
        k = qkv[:, q_dim : q_dim + kv_dim].reshape(batch, cfg.kv_heads, cfg.head_dim)
        v = qkv[:, q_dim + kv_dim :].reshape(batch, cfg.kv_heads, cfg.head_dim)
        k_cache = k_cache.at[i, slot_ids, :, positions].set(k)
        v_cache = v_cache.at[i, slot_ids, :, positions].set(v)
        tuning = {"interpret": interpret, "num_splits": cfg.decode_splits} if mode == "pallas" else {}
        attn = attention(q, k_cache, v_cache, lengths, layer=i, sm_scale=cfg.head_dim**-0.5, **tuning)
        x = x + linear(attn.reshape(batch, q_dim), w["wo"])
        gate_up = linear(_rms_norm(x), w["w_gate_up"])  # [B, 2F]
        x = x + linear(jax.nn.silu(gate_up[:, : cfg.ffn]) * gate_up[:, cfg.ffn :], w["w_down"])
    return x, k_cache, v_cache


def check_decode_stack(cfg: StackConfig, iters: int, roofline_gbs: float, interpret: bool, deadline: float):
    cache_shape = (cfg.layers, cfg.slots, cfg.kv_heads, cfg.max_len, cfg.head_dim)
    lengths = jnp.full((cfg.slots,), cfg.context, jnp.int32)
    kv_read = 2 * cfg.layers * int(lengths.sum()) * cfg.kv_heads * cfg.head_dim * 2  # bf16 K and V rows
    outputs = {}
    for weights in ("bf16", "int8"):
        layers = _init_stack(cfg, int8=weights == "int8")
        weight_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(layers))
        bytes_per_step = weight_bytes + kv_read
        for mode in ("xla", "pallas"):
            if time.monotonic() > deadline:
                _record(f"decode stack {weights} {mode}", None, "skipped: time budget")
                continue
            step = jax.jit(
                functools.partial(_decode_step, cfg=cfg, mode=mode, interpret=interpret),
                donate_argnums=(1, 2),
            )
            k_cache = _normal(jax.random.key(1), cache_shape, jnp.bfloat16)
            v_cache = _normal(jax.random.key(2), cache_shape, jnp.bfloat16)
            x0 = _normal(jax.random.key(3), (cfg.slots, cfg.hidden), jnp.bfloat16)
            compile_start = time.perf_counter()
            x, k_cache, v_cache = jax.block_until_ready(step(layers, k_cache, v_cache, x0, lengths))
            compile_s = time.perf_counter() - compile_start
            outputs[(weights, mode)] = np.asarray(x, np.float32)
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                _, k_cache, v_cache = jax.block_until_ready(step(layers, k_cache, v_cache, x0, lengths))
                times.append(time.perf_counter() - start)
            seconds = float(np.median(times))
            gbs = bytes_per_step / seconds / 1e9
            _record(
                f"decode stack {weights} {mode} L{cfg.layers} B{cfg.slots} ctx{cfg.context}",
                None,
                f"{seconds * 1e3:.2f} ms/step, {cfg.slots / seconds:.0f} tok/s, {gbs:.0f} GB/s = "
                f"{100 * gbs / roofline_gbs:.0f}% of roofline ({bytes_per_step / 1e9:.2f} GB/step, "
                f"roofline {bytes_per_step / roofline_gbs / 1e6:.2f} ms), first call {compile_s:.1f} s",
            )
            del k_cache, v_cache
        if (weights, "xla") in outputs and (weights, "pallas") in outputs:
            a, b = outputs[(weights, "pallas")], outputs[(weights, "xla")]
            err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
            _record(
                f"decode stack {weights} pallas vs xla output",
                bool(np.isfinite(a).all()) and err < 2e-2,
                f"rel err {err:.2e}",
            )
        del layers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes; interpret mode on CPU")
    parser.add_argument("--roofline-gbs", type=float, default=None, help="HBM GB/s (default: detect)")
    parser.add_argument("--iters", type=int, default=None, help="timed runs (default 30, 2 with --dry-run)")
    parser.add_argument("--layers", type=int, default=8, help="decode stack depth (Llama-3-8B has 32)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip stages that start after this")
    args = parser.parse_args(argv)

    start = time.monotonic()
    deadline = start + args.budget_s
    interpret = default_interpret()
    roofline_gbs = args.roofline_gbs or bench_kernels.detect_roofline_gbs()
    iters = args.iters or (2 if args.dry_run else 30)
    print(
        f"jax {jax.__version__} backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
        f"interpret={interpret} roofline={roofline_gbs:.0f} GB/s",
        flush=True,
    )
    if not args.dry_run and interpret:
        print("no accelerator: running the --dry-run shapes instead", flush=True)
    dry_run = args.dry_run or interpret

    check_errors(dry_run, interpret)
    print("\n== kernels vs XLA ==", flush=True)
    for name, builder in bench_kernels.CASE_BUILDERS.items():
        for case in builder(dry_run, interpret):
            if time.monotonic() > deadline:
                _record(f"bench {name}", None, "skipped: time budget")
                break
            row = bench_kernels.run_case(case, iters, roofline_gbs)
            print(bench_kernels.format_row(row, roofline_gbs), flush=True)
            speedup = row["xla_ms"] / row["pallas_ms"]
            _record(
                f"bench {case.kernel} {case.shape}",
                None,
                f"pallas {row['pallas_ms']:.3f} ms vs xla {row['xla_ms']:.3f} ms ({speedup:.2f}x)",
            )

    print("\n== Llama-3-8B-shaped decode stack ==", flush=True)
    cfg = (
        StackConfig(
            hidden=256,
            heads=4,
            kv_heads=2,
            head_dim=64,
            ffn=512,
            layers=2,
            slots=2,
            max_len=64,
            context=40,
            decode_splits=2,
        )
        if dry_run
        else StackConfig(layers=args.layers, slots=args.slots, context=args.context)
    )
    check_decode_stack(cfg, iters, roofline_gbs, interpret, deadline)

    print(f"\n== summary ({time.monotonic() - start:.0f} s) ==")
    width = max(len(check) for check, _, _ in TABLE)
    for check, status, detail in TABLE:
        print(f"{status:4s}  {check:{width}s}  {detail}")
    failures = sum(status == "FAIL" for _, status, _ in TABLE)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
