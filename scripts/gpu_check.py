"""One-shot accelerator check of what jaxinfer ships: its Pallas kernels, then its JaxEngine on a
Llama-3-8B-shaped model (run through scripts/gpu_check.sh on an NVIDIA GPU).

Stage `checks`: each Pallas kernel the engine calls (int8 and int4 weight matmuls, paged decode and
prefill attention over bf16 and int8 pages) against its plain-JAX reference on random inputs.

Stage `engine`: a JaxEngine over random Llama-3-8B-shaped weights (vocab 128256, hidden 4096, MLP 14336,
32 layers, 32 query / 8 KV heads of 128), drawn on the device, for each weight format (bf16, int8, int4
as quantization.quantize_params makes them), with the kernels, fused projections and kernel forms the
runtime uses on this backend and a bf16 KV cache. Decode is timed as scripts/bench_decode.py times it:
every stream prefilled with a --prompt-len prompt, then --steps steps through `engine.decode`, each step
dispatched before the previous one's result is read, the median of --repeats runs. Unlike there, one
engine per format serves every batch size from its first slots (a decode step computes only the row
bucket that holds them, as in serving), and an untimed first run compiles the programs the timed runs
use (engine.warmup() would also compile every smaller row bucket). Per format and batch it reports
aggregate tokens/s, ms per step, the bytes a step must read (the weights the step's kernels read, plus
the K/V pages they visit) and the bandwidth that implies, as a fraction of --hbm-gbps and of the read
bandwidth measured in this run; and the prefill rate of one --prefill-len prompt per format.
Work runs in order of importance (every format at batch 1 and its prefill, then the larger batches),
each result printed and saved as it comes; a format that fails is reported and the next one runs.
Results go to --output, else $OUT/gpu_check.json, with a markdown copy beside it (.md).

    python scripts/gpu_check.py                          # both stages, on the GPU machine
    python scripts/gpu_check.py --stage engine --quick   # batch 1 only
    python scripts/gpu_check.py --tiny --quick --output /tmp/gpu_check.json   # tiny model, any backend
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stub_if_missing(name: str, submodules: tuple[str, ...] = ()) -> bool:
    """Installs an empty module for `name` when it cannot be imported; True if it did."""
    try:
        importlib.import_module(name)
        return False
    except ModuleNotFoundError:
        module = types.ModuleType(name)
        sys.modules[name] = module
        for sub in submodules:
            child = types.ModuleType(f"{name}.{sub}")
            setattr(module, sub, child)
            sys.modules[child.__name__] = child
        return True


# The engine imports structured_output, which imports llguidance at the top but calls it only for
# grammar-constrained requests (none here); the GPU image lacks the package and cannot install it.
LLGUIDANCE_STUBBED = _stub_if_missing("llguidance", ("numpy",))

from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig  # noqa: E402
from jaxinfer.engine import DecodeBatch, PrefillChunk  # noqa: E402
from jaxinfer.jax_engine import JaxEngine  # noqa: E402
from jaxinfer.kernel_dispatch import weight_read_bytes  # noqa: E402
from jaxinfer.kv_cache import contiguous_page_table  # noqa: E402
from jaxinfer.models.params import Params, fuse_projections, layer_shapes, top_shapes  # noqa: E402
from jaxinfer.quantization import quantize_params, weight_bytes  # noqa: E402
from jaxinfer.request import SamplingParams  # noqa: E402
from jaxinfer.roofline import measure_bandwidth_gbs  # noqa: E402
from jaxinfer.weight_formats import Int8Weight, quantize_int4  # noqa: E402
from pallas_kernels import (  # noqa: E402
    default_interpret,
    int4_matmul,
    int4_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    quantize_int8,
    quantize_kv_int8,
)

try:
    from jaxinfer.runtime import add_kernel_forms, default_page_size

    RUNTIME_IMPORT_ERROR: str | None = None
except ModuleNotFoundError as missing:
    # jaxinfer.runtime also imports the file loaders, whose gguf package the GPU image lacks.
    add_kernel_forms = default_page_size = None
    RUNTIME_IMPORT_ERROR = str(missing)

FORMATS = ("bf16", "int8", "int4")
H200_HBM_GBPS = 4800.0
ACCELERATOR_PAGE_SIZE = 16  # runtime.ACCELERATOR_PAGE_SIZE, when jaxinfer.runtime cannot be imported


def _now() -> float:
    return time.monotonic()


# ----------------------------------------------------------------------------------------------------------
# Results: one JSON document (a section per stage) and its markdown rendering, rewritten after each result
# so that a run stopped by its timeout keeps everything measured so far.


class Report:
    def __init__(self, path: Path | None, fresh: bool):
        self.path = path
        self.doc: dict = {}
        if path is not None and not fresh and path.is_file():
            try:
                self.doc = json.loads(path.read_text())
            except (OSError, ValueError):
                self.doc = {}

    def section(self, name: str) -> dict:
        return self.doc.setdefault(name, {})

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        os.replace(tmp, self.path)
        self.path.with_suffix(".md").write_text(markdown(self.doc))


def markdown(doc: dict) -> str:
    """The report as markdown tables: decode per format and batch, prefill, kernel checks."""
    lines = []
    env = doc.get("environment", {})
    if env:
        lines += [f"# gpu_check: {env.get('device_kind', '?')} ({env.get('backend', '?')})", ""]
        lines += [f"- {k}: {v}" for k, v in env.items()]
        lines.append("")
    engine = doc.get("engine", {})
    if engine:
        bw = engine.get("bandwidth", {})
        model = engine.get("model", {})
        peak, measured = bw.get("hbm_gbps_flag"), bw.get("measured_gbps")
        lines += [
            f"## Engine: {model.get('name', '?')}, random weights; "
            + ", ".join(f"{k} {v}" for k, v in engine.get("settings", {}).items()),
            "",
            f"HBM peak (flag) {peak} GB/s; read bandwidth measured in this run {_fmt(measured, '.0f')} GB/s.",
            "",
            "| format | batch | decode tok/s | ms/step | MB/step (weights + KV) | GB/s | % of peak | "
            "% of measured | first run s (compiles) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in engine.get("decode", []):
            lines.append(
                f"| {r['format']} | {r['batch']} | {r['tok_s']:.1f} | {r['ms_per_step']:.2f} | "
                f"{r['step_bytes'] / 1e6:.1f} ({r['weight_bytes'] / 1e6:.1f} + {r['kv_bytes'] / 1e6:.1f}) | "
                f"{r['gbps']:.0f} | {100 * r['roofline_peak']:.0f}% | {_pct(r.get('roofline_measured'))} | "
                f"{r['first_run_s']:.1f} |"
            )
        if engine.get("prefill"):
            lines += [
                "",
                "| format | prefill tokens | tok/s | first call s |",
                "| --- | ---: | ---: | ---: |",
            ]
            for r in engine["prefill"]:
                lines.append(
                    f"| {r['format']} | {r['tokens']} | {r['tok_s']:.0f} | {r['first_call_s']:.1f} |"
                )
        if engine.get("builds"):
            lines += ["", "| format | weights GB | build s |", "| --- | ---: | ---: |"]
            for r in engine["builds"]:
                lines.append(f"| {r['format']} | {r['weight_bytes'] / 1e9:.3f} | {r['seconds']:.1f} |")
        lines += [""] + [f"- error: {r}" for r in engine.get("errors", [])]
        lines += [f"- skipped: {r}" for r in engine.get("skipped", [])]
        lines.append("")
    checks = doc.get("kernel_checks", {})
    if checks:
        lines += [
            f"## Kernel checks: {checks.get('failed', 0)} failed of {len(checks.get('rows', []))}",
            "",
            "| check | status | detail |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {r['check']} | {r['status']} | {r['detail']} |" for r in checks.get("rows", [])]
        lines.append("")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def environment(kernels: KernelConfig) -> dict:
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    env = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "device_memory_gb": round(stats["bytes_limit"] / 1e9, 1) if "bytes_limit" in stats else None,
        "kernels": dataclasses.asdict(kernels),
        "pallas_interpret": default_interpret(),
    }
    if LLGUIDANCE_STUBBED:
        env["llguidance"] = "not installed: stubbed (grammar-constrained output unused here)"
    if RUNTIME_IMPORT_ERROR:
        env["jaxinfer.runtime"] = f"not importable ({RUNTIME_IMPORT_ERROR}): its accelerator defaults used"
    return env


# ----------------------------------------------------------------------------------------------------------
# Stage `checks`: each Pallas kernel the engine calls against its reference.


def _normal(key: jax.Array, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def rel_err(out: jax.Array, ref: jax.Array) -> float:
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _paged_pool(key, *, layers, kv_heads, page_size, head_dim, rows, pages_per_row, dtype):
    """A random page pool [L, K, P, S, D] (plus scales for int8) and a shuffled page table in which row r
    owns pages_per_row distinct pages; page 0 is the null page no row owns."""
    num_pages = 1 + rows * pages_per_row
    shape = (layers, kv_heads, num_pages, page_size, head_dim)
    kk, kv = jax.random.split(key)
    k, v = _normal(kk, shape, jnp.float32), _normal(kv, shape, jnp.float32)
    if dtype == jnp.int8:
        (k, k_scale), (v, v_scale) = quantize_kv_int8(k), quantize_kv_int8(v)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    else:
        k, v, scales = k.astype(dtype), v.astype(dtype), {}
    table = 1 + np.random.default_rng(0).permutation(rows * pages_per_row)
    return k, v, scales, jnp.asarray(table.reshape(rows, pages_per_row), jnp.int32)


TINY_CASES = 4  # --tiny: one case of each kernel, a smoke test that stays quick in interpret mode


def kernel_cases(tiny: bool, interpret: bool) -> list[tuple[str, float, Callable[[], tuple]]]:
    """(name, tolerance, build) with build() -> (kernel output, reference output), most important first:
    the shapes and dtypes a Llama-3-8B decode step runs (bf16 activations, fused qkv 6144 x 4096, down
    4096 x 14336, lm_head 128256 x 4096), then float32 and odd row counts."""
    # f32 dots may run as TF32 in the reference on GPU.
    tol = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5 if interpret else 5e-3}
    hidden, qkv, ffn, vocab = (256, 384, 512, 1024) if tiny else (4096, 6144, 14336, 128256)
    cases: list[tuple[str, float, Callable[[], tuple]]] = []

    def int8_case(m: int, n: int, k: int, dtype, group: int | None = None):
        def build():
            kx, kw = jax.random.split(jax.random.key(m * 7 + n))
            x = _normal(kx, (m, k), dtype)
            w_q, scale = quantize_int8(_normal(kw, (n, k), jnp.float32), group_size=group)
            return int8_matmul(x, w_q, scale, interpret=interpret), int8_matmul_reference(x, w_q, scale)

        name = f"int8_matmul m{m} n{n} k{k} group{group} {jnp.dtype(dtype).name}"
        cases.append((name, tol[dtype], build))

    def int4_case(m: int, n: int, k: int, dtype, group: int = 32):
        def build():
            kx, kw = jax.random.split(jax.random.key(m * 11 + n))
            x = _normal(kx, (m, k), dtype)
            w = quantize_int4(_normal(kw, (n, k), jnp.float32), group_size=group)
            args = (x, w.packed, w.scale, w.minimum)
            out = int4_matmul(*args, group_size=group, interpret=interpret)
            return out, int4_matmul_reference(*args, group_size=group)

        name = f"int4_matmul m{m} n{n} k{k} group{group} {jnp.dtype(dtype).name}"
        cases.append((name, tol[dtype], build))

    heads, kv_heads, dim = (4, 2, 64) if tiny else (32, 8, 128)
    page_size, pages_per_row = 16, (8 if tiny else 128)
    max_len = page_size * pages_per_row

    def decode_case(cache_dtype, splits: int):
        def build():
            rows = 5
            k, v, scales, table = _paged_pool(
                jax.random.key(splits), layers=2, kv_heads=kv_heads, page_size=page_size, head_dim=dim,
                rows=rows, pages_per_row=pages_per_row, dtype=cache_dtype,
            )  # fmt: skip
            q = _normal(jax.random.key(3), (rows, heads, dim), jnp.bfloat16)
            lengths = jnp.array([0, 1, max_len // 3 + 5, max_len - 3, max_len], jnp.int32)
            kwargs = dict(layer=1, sm_scale=dim**-0.5, num_splits=splits, **scales)
            out = paged_decode_attention(q, k, v, lengths, table, interpret=interpret, **kwargs)
            ref = paged_decode_attention_reference(q, k, v, lengths, table, **kwargs)
            if not bool((out[0] == 0).all()):  # an inactive row must come back zero
                out = out.at[0].set(jnp.nan)
            return out, ref

        name = f"paged_decode N{heads}/K{kv_heads} D{dim} {jnp.dtype(cache_dtype).name} pages splits{splits}"
        cases.append((name, tol[jnp.bfloat16], build))

    def prefill_case(cache_dtype):
        def build():
            chunk = 32 if tiny else 256
            k, v, scales, table = _paged_pool(
                jax.random.key(7), layers=2, kv_heads=kv_heads, page_size=page_size, head_dim=dim,
                rows=2, pages_per_row=pages_per_row, dtype=cache_dtype,
            )  # fmt: skip
            q = _normal(jax.random.key(8), (2, chunk, heads, dim), jnp.bfloat16)
            # Row 0 a first chunk, row 1 a chunk after a cached prefix with 5 padding queries.
            q_start = jnp.array([0, max_len // 2], jnp.int32)
            kv_lens = jnp.array([chunk, max_len // 2 + chunk - 5], jnp.int32)
            kwargs = dict(layer=1, sm_scale=dim**-0.5, **scales)
            out = paged_prefill_attention(q, k, v, q_start, kv_lens, table, interpret=interpret, **kwargs)
            ref = paged_prefill_attention_reference(q, k, v, q_start, kv_lens, table, **kwargs)
            valid = lambda x: jnp.concatenate([x[0], x[1, : chunk - 5]])  # noqa: E731 (padding: unspecified)
            return valid(out), valid(ref)

        name = f"paged_prefill N{heads}/K{kv_heads} D{dim} {jnp.dtype(cache_dtype).name} pages"
        cases.append((name, tol[jnp.bfloat16], build))

    bf16, f32 = jnp.bfloat16, jnp.float32
    int8_case(1, qkv, hidden, bf16)
    int4_case(1, qkv, hidden, bf16)
    decode_case(bf16, 1)
    prefill_case(bf16)
    for m in (8, 32):
        int8_case(m, qkv, hidden, bf16)
        int4_case(m, qkv, hidden, bf16)
    int8_case(1, hidden, ffn, bf16)
    int4_case(1, hidden, ffn, bf16)
    int8_case(1, vocab, hidden, bf16)  # lm_head (int8 in both quantised formats)
    decode_case(jnp.int8, 1)
    decode_case(bf16, 4)
    prefill_case(jnp.int8)
    int8_case(130, qkv, hidden, bf16)
    int4_case(130, qkv, hidden, bf16)
    int8_case(16, qkv, hidden, bf16, group=128)
    int4_case(8, qkv, hidden, bf16, group=128)
    int8_case(13, qkv, hidden, f32)
    int4_case(13, qkv, hidden, f32)
    return cases[:TINY_CASES] if tiny else cases


def run_checks(report: Report, tiny: bool, deadline: float) -> int:
    """Runs kernel_cases until the deadline; returns the number of failures."""
    interpret = default_interpret()
    section = report.section("kernel_checks")
    rows = section.setdefault("rows", [])
    start = _now()
    print("\n== kernel checks (Pallas vs reference) ==", flush=True)
    for name, tolerance, build in kernel_cases(tiny, interpret):
        if _now() > deadline:
            status, detail = "skipped", "time budget"
        else:
            case_start = _now()
            try:
                out, ref = jax.block_until_ready(build())
                err = rel_err(out, ref)
                finite = bool(jnp.isfinite(out.astype(jnp.float32)).all())
                status = "ok" if finite and err < tolerance else "FAIL"
                detail = f"rel err {err:.2e} (bound {tolerance:.0e}){'' if finite else ', non-finite'}"
            except Exception as e:  # one kernel failing to lower must not hide the others
                status, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                traceback.print_exc()
            detail += f", {_now() - case_start:.1f} s"
        rows.append({"check": name, "status": status, "detail": detail})
        print(f"[{status}] {name}: {detail}", flush=True)
        section["failed"] = sum(r["status"] == "FAIL" for r in rows)
        section["seconds"] = round(_now() - start, 1)
        report.save()
    return section["failed"]


# ----------------------------------------------------------------------------------------------------------
# Stage `engine`: the JaxEngine on a Llama-3-8B-shaped model.


def llama3_8b_config(max_len: int = 8192) -> ModelConfig:
    return ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=max_len, rms_norm_eps=1e-5,
        rope_theta=500000.0, name="llama3-8b-shaped",
    )  # fmt: skip


def tiny_config() -> ModelConfig:
    return ModelConfig(
        arch="llama", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=64, max_position_embeddings=8192, rope_theta=500000.0, name="tiny",
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("shape", "norm"))
def _random_leaf(key: jax.Array, shape: tuple[int, ...], norm: bool) -> jax.Array:
    if norm:
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    # Drawn in bf16 directly: a float32 draw would hold twice each leaf's bytes (2 GB for a table).
    return jax.random.normal(key, shape, jnp.bfloat16) * jnp.asarray(shape[-1] ** -0.5, jnp.bfloat16)


def random_device_params(config: ModelConfig, seed: int = 0) -> Params:
    """Random bf16 weights in params.py's layout, drawn on the default device leaf by leaf (the host never
    holds them): linear weights ~ N(0, 1 / fan_in), norm weights ~ 1."""
    base = jax.random.key(seed)
    counter = iter(range(1 << 30))

    def leaf(name: str, shape: tuple[int, ...]) -> jax.Array:
        return _random_leaf(jax.random.fold_in(base, next(counter)), shape, name.endswith("norm"))

    params: Params = {name: leaf(name, shape) for name, shape in top_shapes(config).items()}
    params["layers"] = [
        {name: leaf(name, shape) for name, shape in layer_shapes(config).items()}
        for _ in range(config.num_layers)
    ]
    return params


def build_params(config: ModelConfig, fmt: str, kernels: KernelConfig, seed: int = 0) -> Params:
    """Random weights in `fmt` in the form runtime.build_runtime gives a one-device engine: quantised
    (quantize_params consumes the float draw), projections fused, kernel forms added."""
    params = random_device_params(config, seed)
    if fmt != "bf16":
        params = quantize_params(params, fmt)
    params = fuse_projections(params)
    if add_kernel_forms is not None:
        return add_kernel_forms(params, kernels)
    if kernels.matmul != "pallas":
        raise RuntimeError(f"jaxinfer.runtime is needed for {kernels.matmul} matmuls: {RUNTIME_IMPORT_ERROR}")
    return params  # what add_kernel_forms returns for Pallas matmuls


def step_weight_bytes(params: Params, config: ModelConfig, kernels: KernelConfig, rows: int) -> int:
    """Weight bytes one decode step over `rows` rows reads: every layer weight in the form its kernel
    reads (kernel_dispatch.linear), the final norm, the logits head, and the embedding rows looked up."""

    def read(w) -> int:
        return weight_read_bytes(w, rows, kernels)

    head = params["embed"] if config.tie_word_embeddings else params["lm_head"]
    total = read(head) + weight_bytes(params["final_norm"])
    total += sum(read(w) for layer in params["layers"] for w in layer.values())
    embed = params["embed"]
    row_bytes = (
        config.hidden_size + 4 if isinstance(embed, Int8Weight) else weight_bytes(embed) // embed.shape[0]
    )
    return total + rows * row_bytes


def kv_bytes_per_position(config: ModelConfig, cache_dtype: str) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * jnp.dtype(cache_dtype).itemsize


def attended_positions(engine: JaxEngine, rows: int, length: int) -> int:
    """Cache positions one row reads in a decode step whose input sits at position `length`: the Pallas
    kernel visits the row's own pages; other paths read what engine.decode_attend_len says."""
    if engine.kernels.attention == "pallas":
        return -(-(length + 1) // engine.page_size) * engine.page_size
    return engine.decode_attend_len(rows, length)


@dataclasses.dataclass(frozen=True)
class Workload:
    prompt: tuple[int, ...]  # each decode stream's prompt
    prefill_prompt: tuple[int, ...]  # the prefill figure's prompt
    steps: int
    repeats: int

    @property
    def max_len(self) -> int:
        """A power of two holding every request, as bench_decode sizes its engines."""
        longest = max(len(self.prompt) + self.steps, len(self.prefill_prompt))
        return 1 << (longest - 1).bit_length()


GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def make_engine(params: Params, config: ModelConfig, kernels: KernelConfig, work: Workload, slots: int):
    """An engine of `slots` slots, each owning whole-context pages in order, with a bf16 cache. Every
    prefill chunk takes one bucket (the prefill figure's), so one prefill program serves the prompts
    too: one compile fewer per engine, and decode does not depend on how the prompt was computed."""
    max_len = work.max_len
    page_size = default_page_size(None, jax.default_backend()) if default_page_size else ACCELERATOR_PAGE_SIZE
    pages_per_slot = -(-max_len // page_size)
    cache = CacheConfig(
        num_pages=slots * pages_per_slot + 1, page_size=page_size, max_len=max_len, num_slots=slots,
        dtype="bfloat16",
    )  # fmt: skip
    bucket = min(max_len, 1 << (max(len(work.prompt), len(work.prefill_prompt)) - 1).bit_length())
    return JaxEngine(
        params, config, cache, kernels=kernels, max_prefill_chunk=bucket, min_prefill_bucket=bucket
    )


def _prefill(engine: JaxEngine, table: np.ndarray, slot: int, tokens: tuple[int, ...]) -> None:
    chunk = PrefillChunk(slot, tokens, 0, GREEDY, table[slot].tolist(), True, tokens)
    engine.prefill([chunk]).result()


def time_decode(engine: JaxEngine, work: Workload, batch: int) -> dict:
    """bench_decode.bench_ours's decode timing on the first `batch` slots: prefill every stream, then
    `steps` steps each dispatched before the previous result is read; the median of `repeats` runs after
    one untimed run that compiles exactly the programs the timed runs use."""
    slots = engine.num_slots
    table = contiguous_page_table(slots, engine.cache_config.pages_per_seq)
    prompt_len = len(work.prompt)

    def positions(step: int) -> np.ndarray:
        out = np.full(slots, -1, np.int32)
        out[:batch] = prompt_len + step
        return out

    def run() -> float:
        for slot in range(batch):
            _prefill(engine, table, slot, work.prompt)
        start = time.perf_counter()
        pending = engine.decode(DecodeBatch(positions(0), table))
        for step in range(1, work.steps):
            following = engine.decode(DecodeBatch(positions(step), table))
            pending.result()
            pending = following
        out = pending.result()
        if not out.valid[:batch].all():
            raise RuntimeError(f"a stream ended early: valid {out.valid[:batch]}")
        return time.perf_counter() - start

    first_start = time.perf_counter()
    run()
    first_run_s = time.perf_counter() - first_start
    seconds = [run() for _ in range(work.repeats)]
    rates = [batch * work.steps / s for s in seconds]
    return {
        "tok_s": statistics.median(rates),
        "runs_tok_s": [round(r, 2) for r in rates],
        "ms_per_step": 1e3 * statistics.median(seconds) / work.steps,
        "first_run_s": first_run_s,
    }


def time_prefill(engine: JaxEngine, work: Workload, repeats: int = 3) -> dict:
    """One prompt of len(work.prefill_prompt) tokens into slot 0: the first call, then the median of
    `repeats` (bench_ours's prefill figure)."""
    table = contiguous_page_table(engine.num_slots, engine.cache_config.pages_per_seq)
    start = time.perf_counter()
    _prefill(engine, table, 0, work.prefill_prompt)
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _prefill(engine, table, 0, work.prefill_prompt)
        times.append(time.perf_counter() - start)
    return {"tokens": len(work.prefill_prompt), "tok_s": len(work.prefill_prompt) / statistics.median(times),
            "first_call_s": first}  # fmt: skip


def run_engine(report: Report, args: argparse.Namespace, kernels: KernelConfig, deadline: float) -> int:
    """Every (format, batch) in order of importance; returns the number of failed units."""
    config = tiny_config() if args.tiny else llama3_8b_config()
    rng = np.random.default_rng(0)
    high = min(5000, config.vocab_size)
    work = Workload(
        prompt=tuple(int(t) for t in rng.integers(100, high, args.prompt_len)),
        prefill_prompt=tuple(int(t) for t in rng.integers(100, high, args.prefill_len)),
        steps=args.steps,
        repeats=args.repeats,
    )
    batches = [1] if args.quick else sorted(set(args.batches))
    section = report.section("engine")
    section.update(
        model={"name": config.name, "layers": config.num_layers, "hidden": config.hidden_size,
               "intermediate": config.intermediate_size, "heads": config.num_heads,
               "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "vocab": config.vocab_size},
        settings={"prompt_len": args.prompt_len, "steps": args.steps, "repeats": args.repeats,
                  "prefill_len": args.prefill_len, "batches": batches, "slots": max(batches),
                  "kv_cache": "bfloat16", "max_len": work.max_len},
        decode=[], prefill=[], builds=[], errors=[], skipped=[],
    )  # fmt: skip
    print(f"\n== engine: {config.name}, formats {args.formats}, batches {batches} ==", flush=True)
    measured = measure_bandwidth_gbs(args.bandwidth_mib, repeats=10)
    section["bandwidth"] = {"hbm_gbps_flag": args.hbm_gbps, "measured_gbps": round(measured, 1)}
    print(f"HBM peak {args.hbm_gbps:.0f} GB/s (--hbm-gbps), reduction read {measured:.0f} GB/s", flush=True)
    report.save()
    run = _EngineRun(report, section, config, kernels, work, max(batches), args, measured, deadline)
    # Batch 1 (and the prefill figure) of every format first, then the larger batches format by format.
    first = [1] if 1 in batches else batches[:1]
    rest = [b for b in batches if b not in first]
    units = [(fmt, first, True) for fmt in args.formats]
    units += [(fmt, rest, False) for fmt in args.formats if rest]
    unit_seconds: dict[str, float] = {}
    failures = 0
    for fmt, unit_batches, with_prefill in units:
        left = deadline - _now()
        # A format's first unit predicts its second; a first unit is about as long as the last one.
        estimate = unit_seconds.get(fmt, max(unit_seconds.values(), default=0.0))
        if left < estimate or left <= 0:
            run.skip(
                f"{fmt} batches {unit_batches}: time budget ({left:.0f} s left, ~{estimate:.0f} s needed)"
            )
            continue
        unit_start = _now()
        failures += not run.unit(fmt, unit_batches, with_prefill)
        unit_seconds[fmt] = _now() - unit_start
    return failures


@dataclasses.dataclass
class _EngineRun:
    report: Report
    section: dict
    config: ModelConfig
    kernels: KernelConfig
    work: Workload
    slots: int
    args: argparse.Namespace
    measured_gbps: float
    deadline: float

    def skip(self, note: str) -> None:
        self.section["skipped"].append(note)
        print(f"[skipped] {note}", flush=True)
        self.report.save()

    def unit(self, fmt: str, batches: list[int], with_prefill: bool) -> bool:
        """Builds `fmt`'s weights and engine, times decode at `batches` (and prefill), frees them; False
        (with the error reported) if anything failed."""
        stage, start = "build", _now()
        engine = None
        try:
            params = jax.block_until_ready(build_params(self.config, fmt, self.kernels, seed=self.args.seed))
            built_s = _now() - start
            engine = make_engine(params, self.config, self.kernels, self.work, self.slots)
            del params  # the engine holds them
            if with_prefill:
                build = {
                    "format": fmt,
                    "weight_bytes": weight_bytes(engine.params),
                    "seconds": round(built_s, 1),
                }
                self.section["builds"].append(build)
            for batch in batches:
                if _now() > self.deadline:
                    self.skip(f"{fmt} batch {batch}: time budget")
                    continue
                stage = f"decode batch {batch}"
                row = self.decode_row(engine, fmt, batch, time_decode(engine, self.work, batch))
                self.section["decode"].append(row)
                print(_decode_line(row), flush=True)
                self.report.save()
            if with_prefill and _now() < self.deadline:
                stage = "prefill"
                prefill = {"format": fmt, **time_prefill(engine, self.work)}
                self.section["prefill"].append(prefill)
                print(
                    f"[prefill] {fmt:5s} {prefill['tokens']} tokens: {prefill['tok_s']:.0f} tok/s "
                    f"(first call {prefill['first_call_s']:.1f} s)",
                    flush=True,
                )
            return True
        except Exception as e:  # report it and go on with the next format
            error = {"format": fmt, "stage": stage, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
            self.section["errors"].append(error)
            print(f"[error] {fmt} {stage}:", flush=True)
            traceback.print_exc()
            sys.stderr.flush()
            return False
        finally:
            # Free this format's weights and cache before the next format is built.
            engine = None
            gc.collect()
            self.report.save()

    def decode_row(self, engine: JaxEngine, fmt: str, batch: int, timing: dict) -> dict:
        """One decode result with the bytes a step reads and the roofline fractions they imply."""
        weights = step_weight_bytes(engine.params, self.config, self.kernels, batch)
        inputs = [len(self.work.prompt) + s for s in range(self.work.steps)]  # each step's input position
        positions = statistics.fmean(attended_positions(engine, batch, n) for n in inputs)
        kv = int(batch * positions * kv_bytes_per_position(self.config, "bfloat16"))
        gbps = (weights + kv) / (timing["ms_per_step"] / 1e3) / 1e9
        return {
            "format": fmt,
            "batch": batch,
            **timing,
            "weight_bytes": weights,
            "kv_bytes": kv,
            "step_bytes": weights + kv,
            "gbps": gbps,
            "roofline_peak": gbps / self.args.hbm_gbps,
            "roofline_measured": gbps / self.measured_gbps if self.measured_gbps > 0 else None,
            "roofline_tok_s_peak": batch * self.args.hbm_gbps * 1e9 / (weights + kv),
        }


def _decode_line(row: dict) -> str:
    return (
        f"[decode] {row['format']:5s} batch {row['batch']:3d}: {row['tok_s']:9.1f} tok/s, "
        f"{row['ms_per_step']:7.2f} ms/step, {row['step_bytes'] / 1e9:6.3f} GB/step -> "
        f"{row['gbps']:5.0f} GB/s = {100 * row['roofline_peak']:3.0f}% of peak, "
        f"{_pct(row['roofline_measured'])} of measured "
        f"(first run {row['first_run_s']:.1f} s)"
    )


def print_summary(doc: dict) -> None:
    print("\n== summary ==\n" + markdown(doc), flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=("all", "checks", "engine"), default="all")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model, one small case per kernel (any backend)"
    )
    parser.add_argument("--quick", action="store_true", help="decode at batch 1 only")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=None, help="each stream's prompt (128; --tiny 32)")
    parser.add_argument(
        "--prefill-len", type=int, default=None, help="the prefill figure's prompt (512; --tiny 32)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per run (64; --tiny 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decode runs per batch (median)")
    parser.add_argument(
        "--hbm-gbps", type=float, default=H200_HBM_GBPS, help="peak HBM bandwidth (H200: 4800)"
    )
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="buffer of the bandwidth measurement")
    parser.add_argument("--budget-s", type=float, default=450.0, help="start no work after this many seconds")
    parser.add_argument(
        "--checks-budget-s", type=float, default=90.0, help="the kernel checks' share (--stage all)"
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default $OUT/gpu_check.json)")
    parser.add_argument("--compilation-cache", default=None, help="a directory for JAX's persistent cache")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    accelerated = jax.default_backend() != "cpu"
    args.prompt_len = args.prompt_len or (32 if args.tiny else 128)
    args.prefill_len = args.prefill_len or (32 if args.tiny else 512)
    args.steps = args.steps or (8 if args.tiny else 64)
    args.bandwidth_mib = args.bandwidth_mib or (2048 if accelerated and not args.tiny else 64)
    if args.output is None and os.environ.get("OUT"):
        args.output = Path(os.environ["OUT"]) / "gpu_check.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = _now()
    if args.compilation_cache:
        # Engines rebuilt for the larger batches reuse their prefill program from here.
        Path(args.compilation_cache).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    kernels = KernelConfig.for_backend(jax.default_backend())
    report = Report(args.output, fresh=args.stage != "engine")
    env = environment(kernels)
    report.doc["environment"] = env
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    report.save()
    failures = 0
    if args.stage in ("all", "checks"):
        checks_budget = args.checks_budget_s if args.stage == "all" else args.budget_s
        failures += run_checks(report, args.tiny, start + min(checks_budget, args.budget_s))
    if args.stage in ("all", "engine"):
        failures += run_engine(report, args, kernels, start + args.budget_s)
    report.doc.setdefault("seconds", {})[args.stage] = round(_now() - start, 1)
    report.save()
    print_summary(report.doc)
    if args.output:
        print(f"results: {args.output} and {args.output.with_suffix('.md')}", flush=True)
    print(f"{failures} failure(s) in {_now() - start:.0f} s", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
