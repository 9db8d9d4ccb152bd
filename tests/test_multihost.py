"""Two processes on 127.0.0.1, 4 simulated CPU devices each, serve one model sharded over all 8 devices.

Process 0 runs `generate` (continuous batching, more prompts than slots) through a LockstepEngine; process
1 follows. The tokens must equal those of one process with the same weights on one device. Run as a
script (`python tests/test_multihost.py worker ...`), this file is also the worker the test starts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

VOCAB = 128
NUM_SLOTS, MAX_LEN, MAX_TOKENS = 4, 64, 8
MESHES = ("data=1,tensor=8", "data=2,tensor=4")  # the first splits every head group across both hosts
TIMEOUT_S = 150


def _config():
    from jaxinfer.config import ModelConfig

    return ModelConfig(
        arch="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
        num_kv_heads=8, head_dim=8, max_position_embeddings=256,
    )  # fmt: skip


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(t) for t in rng.integers(0, VOCAB, size=n)] for n in (5, 30, 12, 9, 21, 3)]


def _greedy_tokens(engine) -> list[list[int]]:
    from jaxinfer.generate import generate
    from jaxinfer.request import SamplingParams
    from jaxinfer.testing import IdTokenizer

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    return [r.token_ids for r in generate(engine, IdTokenizer(VOCAB), prompts, [greedy] * len(prompts))]


def _engine(mesh_text: str | None):
    from jaxinfer.jax_engine import JaxEngine
    from jaxinfer.models.params import random_params
    from jaxinfer.sharding import make_mesh, parse_mesh
    from jaxinfer.testing import paged_cache_config

    mesh = make_mesh(parse_mesh(mesh_text) if mesh_text else None)
    return JaxEngine(
        random_params(_config(), seed=5), _config(), paged_cache_config(NUM_SLOTS, MAX_LEN),
        mesh=mesh, max_prefill_chunk=16, min_attend_bucket=64,
    )  # fmt: skip


def _worker(process_id: int, port: int, control_port: int, out: str) -> None:
    from jaxinfer import multihost

    cluster = multihost.initialize(
        f"127.0.0.1:{port}", 2, process_id, control_port=control_port, timeout_s=60
    )
    import jax

    results = {}
    for mesh_text in MESHES:
        engine = _engine(mesh_text)
        spans = sorted({d.process_index for d in engine.mesh.devices.flat})
        # every process replays the same calls; process 0 alone sees the results it returns
        tokens = multihost.run(cluster, engine, _greedy_tokens, timeout_s=60)
        if cluster.is_leader:
            results[mesh_text] = {
                "tokens": tokens,
                "processes": spans,
                "local_devices": jax.local_device_count(),
                "cache_spec": [str(a) for a in engine.state.cache.k.sharding.spec],
                "cache_local_shards": len(engine.state.cache.k.addressable_shards),
            }
    if cluster.is_leader:
        Path(out).write_text(json.dumps(results))
    multihost.shutdown()


class _Recording:
    """Wraps an engine and logs every call with its arguments, in order."""

    def __init__(self, inner):
        from jaxinfer.engine import Engine

        log: list = []
        self.log = log

        class Recorder(Engine):
            num_slots = property(lambda _: inner.num_slots)
            max_seq_len = property(lambda _: inner.max_seq_len)
            max_prefill_chunk = property(lambda _: inner.max_prefill_chunk)
            page_size = property(lambda _: inner.page_size)
            num_pages = property(lambda _: inner.num_pages)

            def prefill(self, chunks):
                calls = tuple(
                    (c.slot, tuple(c.token_ids), c.start, c.sampling, tuple(c.page_ids), c.is_last,
                     tuple(c.prompt_token_ids), c.num_generated)
                    for c in chunks
                )  # fmt: skip
                log.append(("prefill", calls))
                return inner.prefill(chunks)

            def decode(self, batch):
                log.append(("decode", batch.positions.tolist(), batch.page_table.tolist()))
                return inner.decode(batch)

        self.engine = Recorder()


def test_followers_replay_every_call_of_process_0_in_order():
    """The control channel alone, over loopback TCP with arithmetic engines: process 1 must see exactly
    the calls process 0 made, arguments included (stop strings end requests early; a rejected call is
    rejected on both)."""
    import threading

    import pytest

    from jaxinfer import multihost
    from jaxinfer.engine import PrefillChunk
    from jaxinfer.generate import generate
    from jaxinfer.request import SamplingParams
    from jaxinfer.testing import IdTokenizer, MockEngine

    port = _free_port()
    clusters = [multihost.Cluster(i, 2, "127.0.0.1", port) for i in range(2)]
    # Mock tokens step by seed + 1 modulo 10, so stop ids and stop strings below are met within 10 tokens.
    leader, follower = _Recording(MockEngine(vocab_size=10)), _Recording(MockEngine(vocab_size=10))
    replayed = []
    thread = threading.Thread(
        target=lambda: replayed.append(multihost.follow(follower.engine, clusters[1], timeout_s=20)),
        daemon=True,
    )
    thread.start()
    with multihost.lead(leader.engine, clusters[0], timeout_s=20) as engine:
        prompts = _prompts()
        sampling = [
            SamplingParams(max_tokens=10, seed=i, stop=("<8>", "<9>") if i % 2 else (), stop_token_ids=(5,))
            for i in range(len(prompts))
        ]
        results = generate(engine, IdTokenizer(VOCAB), prompts, sampling)
        with pytest.raises(ValueError):  # a slot out of range: refused here and on the follower
            engine.prefill([PrefillChunk(99, [1], 0, SamplingParams(), page_ids=[1])])
    thread.join(timeout=20)
    assert not thread.is_alive(), "the follower did not stop at shutdown"
    assert any(r.finish_reason == "stop" for r in results)
    assert sum(op[0] == "decode" for op in leader.log) > 3
    assert follower.log == leader.log
    assert replayed and replayed[0] >= len(leader.log)


def test_engine_calls_cross_the_control_channel_with_every_field():
    """Every field of a prefill chunk and a decode batch survives the control channel's JSON, each set
    away from its default: a field left out would run the follower's program on another input than
    process 0's (a decode batch's `drafting` is an input of its verification program)."""
    import dataclasses

    from jaxinfer import multihost
    from jaxinfer.engine import DecodeBatch, PrefillChunk
    from jaxinfer.request import SamplingParams

    chunk = PrefillChunk(
        slot=2, token_ids=[5, 6], start=3, sampling=SamplingParams(temperature=0.5, seed=4, max_tokens=9),
        page_ids=[1, 2], is_last=False, prompt_token_ids=[1, 2, 3, 5, 6], num_generated=1,
        token_mask=np.array([7, -1], np.int32), drafting=False,
    )  # fmt: skip
    batch = DecodeBatch(
        positions=np.array([3, -1], np.int32), page_table=np.array([[1, 2], [0, 0]], np.int32),
        token_mask=np.array([[1], [-1]], np.int32), drafts=np.array([[4, -1], [-1, -1]], np.int32),
        drafting=np.array([True, False]),
    )  # fmt: skip
    round_trips = [
        (chunk, multihost._chunk_from_json(json.loads(json.dumps(multihost._chunk_to_json(chunk))))),
        (batch, multihost._batch_from_json(json.loads(json.dumps(multihost._batch_to_json(batch))))),
    ]
    for original, back in round_trips:
        for field in dataclasses.fields(original):
            want, got = getattr(original, field.name), getattr(back, field.name)
            if isinstance(want, np.ndarray):  # array fields default to None, or have no default
                assert field.default is None or field.default is dataclasses.MISSING, field.name
                assert got.dtype == want.dtype and np.array_equal(got, want), field.name
            else:
                assert want != field.default, f"{field.name} is left at its default: the test cannot see it"
                assert (list(got) if isinstance(want, list) else got) == want, field.name


def test_cluster_arguments_and_meshes_are_checked():
    import pytest

    from jaxinfer import multihost
    from jaxinfer.sharding import make_mesh

    with pytest.raises(ValueError, match="HOST:PORT"):
        multihost.initialize("10.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="process_id"):
        multihost.initialize("10.0.0.1:1234", 2, 2)
    # this process owns every device here: a mesh cannot span a second process
    multihost.check_mesh_spans_processes(make_mesh({"tensor": 2}), 1)
    with pytest.raises(ValueError, match="covers processes"):
        multihost.check_mesh_spans_processes(make_mesh({"tensor": 2}), 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_decode_the_same_tokens_as_one(tmp_path):
    port, control_port = _free_port(), _free_port()
    out = tmp_path / "tokens.json"
    # The suite's XLA flags, with four devices a process.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env = os.environ | {
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=4", *flags]),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    procs, logs = [], []
    try:
        for i in range(2):
            cmd = [sys.executable, __file__, "worker", str(i), str(port), str(control_port), str(out)]
            logs.append(open(tmp_path / f"process{i}.log", "w"))
            procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        # The reference runs here while the workers start: one process, one device, same weights.
        reference = _greedy_tokens(_engine(None))
        for i, proc in enumerate(procs):
            rc = proc.wait(timeout=TIMEOUT_S)
            log = (tmp_path / f"process{i}.log").read_text()
            assert rc == 0, f"process {i} exited with {rc}:\n{log[-3000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        for f in logs:
            f.close()
    results = json.loads(out.read_text())
    assert set(results) == set(MESHES)
    assert all(len(t) == MAX_TOKENS for t in reference)
    for mesh_text, got in results.items():
        assert got["local_devices"] == 4
        assert got["processes"] == [0, 1], "the mesh must span both processes"
        assert got["tokens"] == reference, mesh_text
    # data=1,tensor=8: 8 KV heads split one per device, 4 of them on this process
    assert results["data=1,tensor=8"]["cache_spec"] == ["None", "tensor", "None", "None", "None"]
    assert results["data=1,tensor=8"]["cache_local_shards"] == 4


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
