#!/usr/bin/env bash
# One command on an NVIDIA GPU machine: kernels vs references, timing vs XLA, Llama-3-8B-shaped decode vs
# the HBM roofline (scripts/gpu_check.py). Needs a Python with a CUDA jax already installed (no network):
#   PYTHON=/path/to/venv/bin/python scripts/gpu_check.sh [--layers 8] [--roofline-gbs 4800]
# Finishes within 8 minutes (gpu_check.py skips stages past its 420 s budget; a hard 470 s timeout backs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Let the decode stack's weights and cache use most of the GPU memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
exec timeout 470 "$PYTHON" scripts/gpu_check.py "$@"
