#!/usr/bin/env bash
# One command on an NVIDIA GPU machine (scripts/gpu_check.py): the Pallas kernels against their references,
# then the JaxEngine decoding a Llama-3-8B-shaped model in bf16, int8 and int4 against the HBM roofline.
#   PYTHON=/path/to/python scripts/gpu_check.sh [--quick] [--hbm-gbps 4800] [--batches 1 8 32]
# Extra arguments go to both stages. Needs a Python with a CUDA jax (the GPU image's python3); the machine
# has no network, so packages it lacks travel as wheels in .whl/ (installed below when present), and
# gpu_check.py stubs llguidance (unused by the check) if it is still missing.
# Ends within 9.5 minutes: the checks stop starting cases after 90 s (killed at 150 s), the engine stage
# stops starting work 40 s before its own hard limit. Results: $OUT (else ./out)/gpu_check.{json,md,log}.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The 8B weights of one format plus its KV cache take at most ~35 GB; leave the rest to XLA's own buffers.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
RESULTS="${OUT:-$PWD/out}"
mkdir -p "$RESULTS"
JSON="$RESULTS/gpu_check.json"
LOG="$RESULTS/gpu_check.log"
rm -f "$JSON" "${JSON%.json}.md"
LIMIT_S=565  # the whole script, in seconds

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv || true
  echo "== stage checks =="
  timeout --kill-after=5 150 "$PYTHON" scripts/gpu_check.py --stage checks --budget-s 90 --output "$JSON" "$@"
  echo "checks exit status $?"
  left=$((LIMIT_S - SECONDS))
  echo "== stage engine ($left s left) =="
  # A persistent compilation cache: the engines rebuilt for the larger batches reuse their prefill program.
  timeout --kill-after=5 "$left" "$PYTHON" scripts/gpu_check.py --stage engine --budget-s $((left - 40)) \
    --compilation-cache /tmp/gpu_check_xla --output "$JSON" "$@"
  echo "engine exit status $?"
} 2>&1 | tee "$LOG"

echo "results ($SECONDS s): $JSON, ${JSON%.json}.md, $LOG"
cat "${JSON%.json}.md" 2>/dev/null || true
