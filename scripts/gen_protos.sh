#!/usr/bin/env bash
# Regenerates the Python gRPC code for protos/ into jaxinfer/proto/ (or into $1, for the freshness test).
# Usage: scripts/gen_protos.sh [OUT_DIR]      (PYTHON=... picks the interpreter; default: .venv/bin/python)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/jaxinfer/proto}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
mkdir -p "$OUT"
"$PYTHON" -m grpc_tools.protoc -I "$ROOT/protos" \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  "$ROOT/protos/jaxinfer/v1/inference.proto"
# protoc writes imports relative to the proto root (`from jaxinfer.v1 import ...`); the code lives in
# the jaxinfer.proto package, so point them there.
sed -i 's/^from jaxinfer\.v1 import/from jaxinfer.proto.jaxinfer.v1 import/' \
  "$OUT/jaxinfer/v1/inference_pb2_grpc.py"
for d in "$OUT" "$OUT/jaxinfer" "$OUT/jaxinfer/v1"; do
  [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
