"""The `jaxinfer` command: JSON output, convert round trip, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxinfer.cli import main

NO_CACHE = ["--compilation-cache", ""]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code: int, err: str, fragment: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxinfer: error:"), err
    assert fragment in lines[0]


def test_unknown_model_exits_2_without_traceback():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", "generate", "--model", "no-such-model", "hello"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "unknown model 'no-such-model'" in proc.stderr


def test_missing_and_corrupt_files(capsys, tmp_path):
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path / "absent.gguf"), "hi")
    _assert_one_line_error(code, err, "no such file")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(os.urandom(4096))
    code, _, err = _run(capsys, "generate", "--model", str(bad), *NO_CACHE, "hi")
    _assert_one_line_error(code, err, "bad.gguf")


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-k", "-3"], "top_k"),
    ],
)
def test_invalid_sampling_values(capsys, flags, fragment):
    code, _, err = _run(capsys, "generate", *flags, "hi")
    _assert_one_line_error(code, err, fragment)


def test_models_lists_the_embedded_models(capsys):
    code, out, _ = _run(capsys, "models")
    assert code == 0
    assert "smollm2-135m-instruct (default)" in out and "gemma3-270m" in out


def test_generate_json_and_convert_round_trip(capsys, tmp_path, tiny_with_tokenizer):
    greedy = ["--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--output", "json", *NO_CACHE]
    code, out, err = _run(capsys, "generate", "--model", str(tiny_with_tokenizer), *greedy, "Hello", "1 2 3")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == ["Hello", "1 2 3"]
    for r in rows:
        assert set(r) >= {"prompt_token_ids", "token_ids", "text", "finish_reason", "ttft_s", "tpot_s"}
        assert set(r) >= {"prefill_tokens_per_s", "decode_tokens_per_s"}
        assert len(r["token_ids"]) == 6 and r["finish_reason"] == "length"
        assert r["ttft_s"] > 0 and r["decode_tokens_per_s"] > 0
    assert rows[1]["prompt_token_ids"][-5:] != rows[0]["prompt_token_ids"][-5:]

    out_dir = tmp_path / "orbax"
    code, out, err = _run(capsys, "convert", "--model", str(tiny_with_tokenizer), str(out_dir))
    assert code == 0, err
    code, out, err = _run(capsys, "generate", "--model", str(out_dir), *greedy, "Hello", "1 2 3")
    assert code == 0, err
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [r["token_ids"] for r in rows]


def test_prompt_longer_than_context(capsys, tiny_with_tokenizer):
    code, _, err = _run(
        capsys, "generate", "--model", str(tiny_with_tokenizer), "--max-len", "32", *NO_CACHE, "word " * 40
    )
    _assert_one_line_error(code, err, "exceeds the context length")


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_quantized_convert_round_trip(capsys, tmp_path, tiny_with_tokenizer, quantize):
    greedy = ["--temperature", "0", "--max-tokens", "6", "--ignore-eos", "--output", "json", *NO_CACHE]
    code, out, err = _run(
        capsys, "generate", "--model", str(tiny_with_tokenizer), "--quantize", quantize, *greedy, "Hi"
    )
    assert code == 0, err
    expected = json.loads(out)
    assert expected["weights"]["quantization"] == quantize
    out_dir = tmp_path / f"orbax-{quantize}"
    # int4 from float weights calibrates its clipping ranges unless told not to; round to nearest here
    # gives the same weights as `generate --quantize int4`.
    code, out, err = _run(
        capsys, "convert", "--model", str(tiny_with_tokenizer), "--quantize", quantize,
        "--calibration-steps", "0", str(out_dir),
    )  # fmt: skip
    assert code == 0, err
    assert f"weights {quantize}" in out
    code, out, err = _run(capsys, "generate", "--model", str(out_dir), *greedy, "Hi")
    assert code == 0, err
    got = json.loads(out)
    assert got["token_ids"] == expected["token_ids"] and got["weights"] == expected["weights"]


def test_the_readme_first_command_answers_correctly():
    """The README's first command, as written there, on the embedded default model, in a process of its
    own with XLA's production settings (the suite compiles its programs with cheaper ones: conftest.py)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    [line] = [s for s in readme.splitlines() if "&& .venv/bin/jaxinfer generate" in s][:1]
    argv = shlex.split(line.split(".venv/bin/jaxinfer", 1)[1])
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxinfer.cli", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_int4_convert_from_float_weights_calibrates_with_optax(capsys, tmp_path, tiny_with_tokenizer):
    out_dir = tmp_path / "orbax-int4-calibrated"
    code, out, err = _run(
        capsys, "convert", "--model", str(tiny_with_tokenizer), "--quantize", "int4",
        "--calibration-steps", "5", str(out_dir),
    )  # fmt: skip
    assert code == 0, err
    assert "clipping calibrated with optax" in out
    greedy = ["--temperature", "0", "--max-tokens", "4", "--ignore-eos", "--output", "json", *NO_CACHE]
    code, out, err = _run(capsys, "generate", "--model", str(out_dir), *greedy, "Hi")
    assert code == 0, err
    assert json.loads(out)["weights"]["quantization"] == "int4"
