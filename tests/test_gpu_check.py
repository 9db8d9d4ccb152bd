"""scripts/gpu_check.py end to end on the CPU with --tiny --quick: one case per Pallas kernel against its
reference (interpret mode), then the engine decoding and prefilling a 2-layer model in every weight format,
with the JSON and markdown results written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load_script(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_tiny_quick_run_reports_every_format(tmp_path, monkeypatch):
    gpu_check = _load_script(monkeypatch)
    output = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--tiny", "--quick", "--output", str(output)]) == 0

    doc = json.loads(output.read_text())
    checks = doc["kernel_checks"]
    assert checks["failed"] == 0
    assert {row["check"].split()[0] for row in checks["rows"]} == {
        "int8_matmul",
        "int4_matmul",
        "paged_decode",
        "paged_prefill",
    }

    engine = doc["engine"]
    assert engine["errors"] == [] and engine["skipped"] == []
    decode = {row["format"]: row for row in engine["decode"]}
    assert set(decode) == {"bf16", "int8", "int4"}
    for row in decode.values():
        assert row["batch"] == 1
        assert row["tok_s"] > 0 and row["ms_per_step"] > 0
        assert row["step_bytes"] == row["weight_bytes"] + row["kv_bytes"] > 0
        assert row["gbps"] > 0 and row["roofline_peak"] > 0
    # Quantised weights are fewer bytes to read.
    assert decode["bf16"]["weight_bytes"] > decode["int8"]["weight_bytes"] > decode["int4"]["weight_bytes"]
    assert {row["format"] for row in engine["prefill"] if row["tok_s"] > 0} == {"bf16", "int8", "int4"}
    assert engine["bandwidth"]["measured_gbps"] > 0
    assert "| int4 | 1 |" in output.with_suffix(".md").read_text()
