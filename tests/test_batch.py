"""`jaxinfer batch`: same greedy outputs as `generate`, resume after SIGKILL, bad lines with line numbers."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from jaxinfer.batch import parse_input, read_done_ids, run_batch
from jaxinfer.cli import main
from jaxinfer.request import SamplingParams
from jaxinfer.testing import FakeTokenizer, MockEngine

NO_CACHE = ["--compilation-cache", ""]
SMALL_ENGINE = ["--slots", "3", "--max-len", "64", "--max-prefill-chunk", "16"]
QUIET = ["--no-warmup", "--no-progress"]


def _write_jsonl(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_matches_generate_greedy(capsys, tmp_path, tiny_with_tokenizer):
    from jaxinfer.generate import generate
    from jaxinfer.runtime import RuntimeOptions, build_runtime

    rows = [
        {"id": "p0", "prompt": "Hello there"},
        {"id": "p1", "prompt": "1 2 3 4 5 6 7 8 9 10 11 12 13 14", "max_tokens": 7},  # two prefill chunks
        {"id": 2, "messages": [{"role": "user", "content": "What is JAX?"}], "max_tokens": 3},
        {"id": "p3", "prompt": "The quick brown fox", "ignore_eos": True},
        {"id": "p4", "prompt": "Once upon a time", "max_tokens": 9, "seed": 5},
    ]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code = main(
        ["batch", "--model", str(tiny_with_tokenizer), "--temperature", "0", "--max-tokens", "5",
         *SMALL_ENGINE, *QUIET, *NO_CACHE, str(tmp_path / "in.jsonl"), str(out)]
    )  # fmt: skip
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "requests: 5 generated" in err and "TTFT p50 / p95 / p99" in err
    results = {r["id"]: r for r in _read_jsonl(out)}
    assert sorted(results, key=str) == sorted((r["id"] for r in rows), key=str)

    # The reference: the single-threaded offline loop on a fresh engine, same prompts and settings.
    runtime = build_runtime(
        RuntimeOptions(model=str(tiny_with_tokenizer), num_slots=2, max_len=64, max_prefill_chunk=16,
                       compilation_cache_dir=None)
    )  # fmt: skip
    tok = runtime.tokenizer
    defaults = SamplingParams(temperature=0.0, max_tokens=5)
    prompts, samplings = [], []
    for row in rows:
        prompts.append(tok.encode_chat(row["messages"]) if "messages" in row else tok.encode(row["prompt"]))
        overrides = {k: row[k] for k in ("max_tokens", "seed", "ignore_eos") if k in row}
        samplings.append(dataclasses.replace(defaults, **overrides))
    expected = generate(runtime.engine, tok, prompts, samplings)
    for row, prompt, ref in zip(rows, prompts, expected):
        got = results[row["id"]]
        assert got["token_ids"] == ref.token_ids, row
        assert got["text"] == ref.text
        assert got["finish_reason"] == ref.finish_reason
        u = got["usage"]
        assert u["prompt_tokens"] == len(prompt) and u["completion_tokens"] == len(ref.token_ids)
        assert 0 < u["ttft_s"] <= u["e2e_s"] and u["queue_time_s"] >= 0
    assert len(results["p3"]["token_ids"]) == 5  # ignore_eos: always the full max_tokens


def test_bad_lines_are_reported_with_line_numbers_and_strict_exits_2(capsys, tmp_path, tiny_with_tokenizer):
    rows = [
        {"id": "ok1", "prompt": "Hello"},
        "{not json",
        {"id": "ok1", "prompt": "again"},  # duplicate id
        {"prompt": "no id"},
        {"id": "t", "prompt": "hot", "temperature": -0.5},
        {"id": "long", "prompt": "word " * 80},  # longer than --max-len 64
        {"id": "both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": "ok2", "prompt": "World", "top_k": 3},
    ]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["batch", "--model", str(tiny_with_tokenizer), "--temperature", "0", "--max-tokens", "4",
            *SMALL_ENGINE, *QUIET, *NO_CACHE, str(tmp_path / "in.jsonl")]  # fmt: skip

    code = main([*args, str(tmp_path / "out.jsonl")])
    _, err = capsys.readouterr()
    assert code == 0, err
    expected_errors = [
        (2, "invalid JSON"), (3, "duplicate id 'ok1' (first on line 1)"), (4, "id=None"),
        (5, "temperature"), (6, "exceeds the context length"), (7, "exactly one of"),
    ]  # fmt: skip
    for line, fragment in expected_errors:
        [message] = [m for m in err.splitlines() if f"in.jsonl:{line}: " in m]
        assert message.startswith("skipped ") and fragment in message, message
    assert "6 bad input lines (of 8 lines)" in err
    assert sorted(r["id"] for r in _read_jsonl(tmp_path / "out.jsonl")) == ["ok1", "ok2"]

    code = main([*args, "--strict", str(tmp_path / "strict.jsonl")])
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxinfer: error:")
    assert "in.jsonl:2: invalid JSON" in lines[0]
    assert not (tmp_path / "strict.jsonl").exists() or (tmp_path / "strict.jsonl").read_text() == ""


def test_parse_input_rejects_bad_values_without_a_model(tmp_path):
    tok, engine = FakeTokenizer(), MockEngine(max_seq_len=32, vocab_size=FakeTokenizer().vocab_size)
    rows = [
        {"id": True, "prompt": "a"},
        {"id": "x", "prompt": "a", "top_k": 1.5},
        {"id": "y", "prompt": "a", "stop": [1]},
        {"id": "z", "prompt": "a", "colour": "red"},
        {"id": "w", "messages": []},
        {"id": "v", "prompt": "a", "max_tokens": 0},
        {"id": "u", "prompt": "hello", "stop": "lo", "metadata": {"k": 1}},
    ]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    errors = tmp_path / "errors.txt"
    with open(errors, "w") as f:
        items, num_lines, num_bad = parse_input(tmp_path / "in.jsonl", tokenizer=tok, engine=engine, errors=f)
    reported = errors.read_text().splitlines()
    assert (num_lines, num_bad, len(reported)) == (7, 6, 6)
    fragments = ["id=True", "top_k=1.5", "stop=", "colour", "messages", "max_tokens"]
    for line, fragment in enumerate(fragments, start=1):
        assert f":{line}: " in reported[line - 1] and fragment in reported[line - 1]
    [item] = items
    assert item.line_number == 7 and item.sampling.stop == ("lo",) and item.metadata == {"k": 1}
    assert list(item.prompt_token_ids) == tok.encode("hello")


_KILLABLE_RUN = textwrap.dedent(
    """
    import sys
    from jaxinfer.batch import run_batch
    from jaxinfer.testing import FakeTokenizer, MockEngine

    tok = FakeTokenizer()
    delay = float(sys.argv[3])
    engine = MockEngine(num_slots=3, max_seq_len=64, vocab_size=tok.vocab_size, step_delay_s=delay)
    summary = run_batch(engine, tok, sys.argv[1], sys.argv[2], base_fields={"max_tokens": 6},
                        max_queue=4, progress=False)
    print(summary.num_already_done, summary.num_requests)
    """
)


def _expected_tokens(engine: MockEngine, tok: FakeTokenizer, row: dict) -> list[int]:
    s = SamplingParams(max_tokens=6, seed=row["seed"], stop_token_ids=tok.eos_ids)
    return engine.reference_tokens(tok.encode(row["prompt"]), s)


def test_sigkill_mid_run_then_resume_gives_complete_duplicate_free_output(tmp_path):
    tok = FakeTokenizer()
    rows = [{"id": f"r{i}", "prompt": "hello world " * (1 + i % 3), "seed": i % 7} for i in range(60)]
    _write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    script = tmp_path / "run.py"
    script.write_text(_KILLABLE_RUN)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # 60 requests x 6 steps over 3 slots at 20 ms a step: ~2.5 s of work, killed after a few results.
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "in.jsonl"), str(out), "0.02"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (out.exists() and out.read_text().count("\n") >= 5):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no results appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    lines = out.read_text().splitlines()
    assert 5 <= len(lines) < len(rows), "the kill landed after the run finished"
    # A kill during a write leaves a partial last line: simulate one on top of the real kill.
    with open(out, "a") as f:
        f.write('{"id": "r59", "text": "trunc')
    num_before = len(read_done_ids(out))  # also truncates the partial line
    assert num_before == len(lines) and out.read_text().endswith("\n")
    with open(out, "a") as f:
        f.write('{"id": "r58", "te')

    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "in.jsonl"), str(out), "0.0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(num_before), str(len(rows) - num_before)]
    results = _read_jsonl(out)  # every line parses
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in rows)  # complete, no duplicates
    engine = MockEngine(num_slots=3, max_seq_len=64, vocab_size=tok.vocab_size)
    by_id = {r["id"]: r for r in rows}
    for r in results:
        assert r["token_ids"] == _expected_tokens(engine, tok, by_id[r["id"]]), r["id"]
        assert r["text"] == tok.decode(r["token_ids"])

    # A third run finds nothing to do and leaves the file as it is.
    before = out.read_bytes()
    summary = run_batch(
        engine, tok, tmp_path / "in.jsonl", out, base_fields={"max_tokens": 6}, progress=False
    )
    assert (summary.num_already_done, summary.num_requests) == (len(rows), 0)
    assert out.read_bytes() == before
