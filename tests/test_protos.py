"""The checked-in generated gRPC code matches protos/ (regenerated into a temp dir and compared)."""

import filecmp
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _files(directory: pathlib.Path) -> set[str]:
    return {
        str(p.relative_to(directory))
        for p in directory.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_generated_code_is_up_to_date(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env)
    checked_in = ROOT / "jaxinfer" / "proto"
    assert _files(tmp_path) == _files(checked_in)
    stale = [
        f for f in sorted(_files(tmp_path)) if not filecmp.cmp(tmp_path / f, checked_in / f, shallow=False)
    ]
    assert not stale, f"run scripts/gen_protos.sh: {stale} differ from protos/"


def test_generated_code_imports_as_a_package():
    from jaxinfer.proto.jaxinfer.v1 import inference_pb2, inference_pb2_grpc

    assert inference_pb2.DESCRIPTOR.package == "jaxinfer.v1"
    assert hasattr(inference_pb2_grpc, "InferenceServiceStub")
    request = inference_pb2.GenerateRequest(prompt="x", max_tokens=0)
    assert request.HasField("max_tokens") and not request.sampling.HasField("temperature")
