"""Quality and memory of int8 and int4 weights against the float model, teacher-forced on a fixed text.

    .venv/bin/python scripts/eval_quantization.py [--model smollm2-135m-instruct] [--modes int8 int4]
        [--calibration-steps 80]

Prints weight bytes before and after, greedy agreement per position and both perplexities:
  int8: for each int8 matmul form this backend can run.
  int4: the GGUF file's own 4- and 5-bit blocks repacked (--quantize int4 on a GGUF model; its others
        int8) against the dequantised file; and int4 from the float weights at groups of 32 and 128,
        round-to-nearest against clipping ranges calibrated with optax (int4_calibration.py) on a
        different text than the one evaluated.
The reference is the float32 model (for the embedded models: the GGUF file dequantised).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import KernelConfig
from jaxinfer.cpu_kernels.native_build import cpu_description
from jaxinfer.evaluation import EVAL_TEXT, compare, teacher_forced_decode_logits, teacher_forced_logits
from jaxinfer.int4_calibration import CALIBRATION_TEXT, calibrate_int4
from jaxinfer.loading import load_model
from jaxinfer.loading.gguf_loader import load_gguf
from jaxinfer.models.params import fuse_projections
from jaxinfer.quantization import add_bf16_copies, add_vnni_weights, quantize_params, weight_bytes
from jaxinfer.runtime import add_kernel_forms, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--calibration-steps", type=int, default=80, help="Adam steps per layer")
    args = parser.parse_args()
    print(cpu_description())
    if "int8" in args.modes:
        evaluate_int8(args.model)
    if "int4" in args.modes:
        evaluate_int4(args.model, args.calibration_steps)


def _report(name: str, reference: np.ndarray, logits: np.ndarray, tokens: list[int]) -> None:
    result = compare(reference, logits, tokens)
    print(
        f"{name}: greedy agreement {result.greedy_agreement:.1%} over {result.positions} positions; "
        f"perplexity {result.reference_perplexity:.3f} -> {result.candidate_perplexity:.3f} "
        f"({result.candidate_perplexity / result.reference_perplexity - 1:+.2%})"
    )


def evaluate_int4(model: str, calibration_steps: int) -> None:
    loaded = load_model(model)
    tokenizer = load_tokenizer(loaded)
    tokens = tokenizer.encode(EVAL_TEXT)
    config = loaded.config
    reference = teacher_forced_logits(loaded.params, config, tokens, KernelConfig())
    float_bytes = weight_bytes(loaded.params)
    kernels = KernelConfig.for_backend(jax.default_backend())  # what the CLI runs on this machine
    print(f"{model}: int4, {len(tokens)} tokens of fixed text; float32 weights {float_bytes / 2**20:.1f} MiB")

    def run(name: str, params) -> None:
        kind = {type(w).__name__ for layer in params["layers"] for w in layer.values()}
        print(f"  {name}: {weight_bytes(params) / 2**20:.1f} MiB ({weight_bytes(params) / float_bytes:.1%} "
              f"of float32; layer weights {sorted(kind)})")  # fmt: skip
        _report(f"  {name}, exact weights (XLA)", reference, teacher_forced_logits(params, config, tokens,
                KernelConfig()), tokens)  # fmt: skip
        if kernels.matmul == "native":
            native = add_kernel_forms(fuse_projections(params), kernels)
            _report(f"  {name}, CPU default (native kernels)", reference,
                    teacher_forced_logits(native, config, tokens, kernels), tokens)  # fmt: skip

    if loaded.kind == "gguf":
        blocks = quantize_params(load_gguf(loaded.path, int4=True).params, "int8")
        run("the GGUF file's 4- and 5-bit blocks, other tensors int8", blocks)
    calibration = tokenizer.encode(CALIBRATION_TEXT)
    for group_size in (32, 128):
        copy = jax.tree.map(jnp.copy, loaded.params)  # quantize_params consumes its input
        run(f"int4 g{group_size} round-to-nearest", quantize_params(copy, "int4", group_size=group_size))
        start = time.perf_counter()
        clips, fits = calibrate_int4(
            loaded.params, config, calibration, group_size=group_size, steps=calibration_steps
        )
        seconds = time.perf_counter() - start
        gain = sum(f.rtn_error for f in fits) / sum(f.calibrated_error for f in fits)
        print(f"  calibrated {len(clips)} weights in {seconds:.0f} s ({calibration_steps} Adam steps per "
              f"layer; summed layer output error {gain:.2f}x lower than round-to-nearest)")  # fmt: skip
        copy = jax.tree.map(jnp.copy, loaded.params)
        run(f"int4 g{group_size} optax-calibrated", quantize_params(copy, "int4", group_size=group_size,
            clips=clips))  # fmt: skip


def evaluate_int8(model: str) -> None:
    loaded = load_model(model)
    tokens = load_tokenizer(loaded).encode(EVAL_TEXT)
    reference = teacher_forced_logits(loaded.params, loaded.config, tokens, KernelConfig())
    kernels = KernelConfig.for_backend(jax.default_backend())  # what the CLI runs on this machine
    float_bytes = weight_bytes(loaded.params)
    quantized = quantize_params(loaded.params)
    int8_bytes = weight_bytes(quantized)
    print(f"{model}: int8, {len(tokens)} tokens of fixed text")
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
        _report(name, reference, logits, tokens)


if __name__ == "__main__":
    main()
