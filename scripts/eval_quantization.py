"""Quality and memory of int8 weights against the float model, teacher-forced on a fixed text.

    .venv/bin/python scripts/eval_quantization.py [--model smollm2-135m-instruct]

Prints weight bytes before and after, greedy agreement per position and both perplexities, for each
int8 matmul form this backend can run.
"""

from __future__ import annotations

import argparse

import jax

from jaxinfer.config import KernelConfig
from jaxinfer.evaluation import EVAL_TEXT, compare, teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.loading import load_model
from jaxinfer.quantization import add_bf16_copies, add_vnni_weights, quantize_params, weight_bytes
from jaxinfer.runtime import load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()

    loaded = load_model(args.model)
    tokens = load_tokenizer(loaded).encode(EVAL_TEXT)
    reference = teacher_forced_logits(loaded.params, loaded.config, tokens, KernelConfig())
    kernels = KernelConfig.for_backend(jax.default_backend())  # what the CLI runs on this machine
    float_bytes = weight_bytes(loaded.params)
    quantized = quantize_params(loaded.params)
    int8_bytes = weight_bytes(quantized)
    print(f"{args.model}: {len(tokens)} tokens of fixed text")
    print(f"weights: float32 {float_bytes / 2**20:.1f} MiB -> int8 {int8_bytes / 2**20:.1f} MiB "
          f"({int8_bytes / float_bytes:.1%})")  # fmt: skip
    with_copies = add_bf16_copies(quantized)
    print(f"with the bf16 copies for several rows: {weight_bytes(with_copies) / 2**20:.1f} MiB "
          f"({weight_bytes(with_copies) / float_bytes:.1%})")  # fmt: skip
    forms = {
        "int8 weights; several rows in bf16": (KernelConfig(), with_copies),
        "int8 weights, float activations": (KernelConfig(), quantized),
        "int8 weights, int8 activations": (KernelConfig(int8_activations=True), quantized),
    }
    default_name, default = "int8 weights; several rows in bf16 (CPU default)", (KernelConfig(), with_copies)
    if kernels.matmul == "native":  # the native kernels: VNNI matmul, and decode attention from 2 rows
        packed = add_vnni_weights(quantized)
        print(f"with the weights packed for the VNNI kernel: {weight_bytes(packed) / 2**20:.1f} MiB "
              f"({weight_bytes(packed) / float_bytes:.1%})")  # fmt: skip
        default_name = "int8 weights; several rows through the VNNI kernel (CPU default)"
        default = (kernels, packed)
    forms[default_name] = default
    candidates = {
        name: teacher_forced_logits(weights, loaded.config, tokens, form)
        for name, (form, weights) in forms.items()
    }
    # Decode of 16 slots at a time, fed the text one token per step: the path the CPU default serves
    # with, including its KV cache.
    for cache_dtype in ("bfloat16", "float32"):
        name = f"CPU default decoding 16 rows, {cache_dtype} KV cache"
        candidates[name] = teacher_forced_decode_logits(
            default[1], loaded.config, tokens, default[0], rows=16, cache_dtype=cache_dtype
        )
    for name, logits in candidates.items():
        result = compare(reference, logits, tokens)
        print(
            f"{name}: greedy agreement {result.greedy_agreement:.1%} over {result.positions} positions; "
            f"perplexity {result.reference_perplexity:.3f} -> {result.candidate_perplexity:.3f} "
            f"({result.candidate_perplexity / result.reference_perplexity - 1:+.2%})"
        )


if __name__ == "__main__":
    main()
