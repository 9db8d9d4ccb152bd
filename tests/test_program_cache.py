"""Compiled programs kept on disk and loaded without tracing (program_cache), across processes as a
restarted server meets them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

from jaxinfer.config import KernelConfig, ModelConfig
from jaxinfer.cpu_kernels import decode_attention_available
from jaxinfer.generate import generate
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.models.params import random_params
from jaxinfer.program_cache import ProgramCache
from jaxinfer.request import SamplingParams
from jaxinfer.runtime import RuntimeOptions, program_cache_dir
from jaxinfer.sharding import make_mesh
from jaxinfer.testing import IdTokenizer, paged_cache_config

LLAMA = ModelConfig(
    arch="llama", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, max_position_embeddings=256,
)  # fmt: skip
PROMPTS = [[5, 9, 2, 77, 31, 8, 8, 40], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]


def engine(directory: str, slots: int = 2) -> JaxEngine:
    """Native attention where the CPU runs it: a loaded program then calls a kernel its process never
    traced."""
    kernels = KernelConfig(attention="native") if decode_attention_available() else None
    return JaxEngine(
        random_params(LLAMA, seed=4), LLAMA, paged_cache_config(slots, 64, page_size=8), kernels=kernels,
        program_cache_dir=directory,
    )  # fmt: skip


def tokens(e: JaxEngine) -> list[list[int]]:
    sampling = [SamplingParams(temperature=0, max_tokens=9)] * len(PROMPTS)
    return [c.token_ids for c in generate(e, IdTokenizer(LLAMA.vocab_size), PROMPTS, sampling)]


def no_tracing(self, key, args):
    raise AssertionError(f"{key} was compiled, not loaded")


def run(directory: str, scenario: str) -> dict:
    """One scenario in a process of its own. "compile": a first engine warms up; "load": a later one
    must load every program (tracing raises), then one of another cache shape, whose programs differ;
    "again": an engine that warms up, then one that only decodes (loading one program at a time)."""
    report = {}
    if scenario == "load":
        compile_for_real = JaxEngine._compile
        JaxEngine._compile = no_tracing
        e = engine(directory)
        e.warmup()
        report["load"] = (tokens(e), e.loaded_count, e.compile_count)
        JaxEngine._compile = compile_for_real
        e = engine(directory, slots=4)
        report["other"] = (tokens(e), e.loaded_count, e.compile_count)
    else:
        e = engine(directory)
        e.warmup()
        report[scenario] = (tokens(e), e.loaded_count, e.compile_count)
        if scenario == "again":
            e = engine(directory)
            report["decode only"] = (tokens(e), e.loaded_count, e.compile_count)
    return report


def in_process(directory: Path, scenario: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    # No JAX persistent cache in these processes: the programs kept must be compiled afresh.
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = str(root)
    code = "import json, sys; from tests.test_program_cache import run; print(json.dumps(run(*sys.argv[1:])))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(directory), scenario], cwd=root, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


def test_a_restarted_engine_loads_its_programs_and_decodes_the_same_tokens(tmp_path):
    first = in_process(tmp_path, "compile")
    expected, loaded, ready = first["compile"]
    assert loaded == 0 and ready > 0 and len(list(tmp_path.glob("*.program"))) == ready
    assert all(len(t) == 9 for t in expected)

    later = in_process(tmp_path, "load")
    assert later["load"] == [expected, ready, ready]
    other_tokens, other_loaded, other_ready = later["other"]
    assert other_tokens == expected and other_loaded == 0 and other_ready > 0

    for path in tmp_path.glob("*.program"):  # damaged entries: compiled again, and replaced
        path.write_bytes(b"not a program")
    again = in_process(tmp_path, "again")
    assert again["again"] == [expected, 0, ready] and "unusable" in again["log"]
    decode_tokens, decode_loaded, decode_ready = again["decode only"]
    assert decode_tokens == expected and decode_loaded == decode_ready > 0


def test_a_full_folder_loses_the_entries_used_longest_ago(tmp_path):
    for i, name in enumerate(["c", "a", "d", "b"]):  # used in this order: c longest ago
        path = tmp_path / f"{name}.program"
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    (tmp_path / "other.file").write_bytes(b"y" * 5000)  # not an entry: left alone
    ProgramCache(tmp_path, "context", jax.devices()[:1], max_bytes=2500)._evict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.program", "d.program", "other.file"]


def test_only_a_one_device_runtime_that_asks_keeps_programs(tmp_path):
    asks = RuntimeOptions(program_cache=True, compilation_cache_dir=str(tmp_path))
    assert program_cache_dir(asks, make_mesh()) == tmp_path / "programs"
    assert program_cache_dir(dataclasses.replace(asks, program_cache=False), make_mesh()) is None
    assert program_cache_dir(dataclasses.replace(asks, compilation_cache_dir=None), make_mesh()) is None
    assert program_cache_dir(asks, make_mesh({"data": 2})) is None  # a mesh: JAX's cache instead
