"""Trains draft heads for speculative decoding on text the target model generates itself.

    .venv/bin/python scripts/train_draft_heads.py [--model smollm2-135m-instruct] [--prompts 384]
        [--max-tokens 192] [--steps 800] [--out DIR]

1. builds the runtime as `jaxinfer generate` would (--quantize auto: the weights the engine serves);
2. answers the first --prompts of speculation_prompts.TRAINING_PROMPTS with the target itself, 16 at a
   time, greedy and a share (--sampled-share) at temperature 0.7;
3. runs the engine's own params and kernels over every prompt + answer once for the hidden states;
4. fits the heads (speculation/training.py) and saves them with their metrics to --out (default
   $JAXINFER_CACHE_DIR/draft_heads/<model>, ~/.cache/jaxinfer/draft_heads/<model> without it).

Prints each phase's wall time and the held-out metrics: top-1 accuracy per depth (teacher-forced) and
the expected drafts accepted per step under greedy verification.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from speculation_prompts import TRAINING_PROMPTS

from jaxinfer.generate import generate
from jaxinfer.registry import DEFAULT_MODEL
from jaxinfer.request import SamplingParams, with_eos
from jaxinfer.runtime import RuntimeOptions, build_runtime, default_heads_dir
from jaxinfer.speculation.draft_heads import save_heads
from jaxinfer.speculation.training import hidden_states, train_heads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument(
        "--prompts", type=int, default=384, help=f"training prompts (at most {len(TRAINING_PROMPTS)})"
    )
    p.add_argument("--max-tokens", type=int, default=192, help="tokens generated per prompt")
    p.add_argument("--slots", type=int, default=16, help="requests generated at once")
    p.add_argument("--sampled-share", type=float, default=0.25, help="share of prompts sampled, not greedy")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled share")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--freeze-output", action="store_true", help="keep the target's output rows as they are")
    p.add_argument("--holdout-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default: $JAXINFER_CACHE_DIR/draft_heads/<model>")
    return p.parse_args()


def _log(line: str) -> None:
    print(f"  {line}", flush=True)


def main() -> None:
    args = parse_args()
    prompts_text = TRAINING_PROMPTS[: args.prompts]
    start = time.perf_counter()
    runtime = build_runtime(
        RuntimeOptions(model=args.model, quantize=args.quantize, num_slots=args.slots, max_len=1024)
    )
    engine, tokenizer, config = runtime.engine, runtime.tokenizer, runtime.config
    model_name = runtime.model_info()["model_name"]
    load_seconds = time.perf_counter() - start
    print(f"loaded {model_name} ({runtime.model_info()['quantization']}) in {load_seconds:.1f}s")

    prompts = [tokenizer.encode_chat([{"role": "user", "content": text}]) for text in prompts_text]
    sampled = set(
        np.random.default_rng(args.seed).permutation(len(prompts))[: round(args.sampled_share * len(prompts))]
    )
    sampling = [
        with_eos(
            SamplingParams(
                temperature=args.temperature if i in sampled else 0.0, max_tokens=args.max_tokens,
                seed=args.seed + i,
            ),
            tokenizer.eos_ids,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    start = time.perf_counter()
    completions = generate(engine, tokenizer, prompts, sampling)
    generate_seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for c in completions)
    print(
        f"generated {generated} tokens for {len(prompts)} prompts ({len(sampled)} sampled at "
        f"temperature {args.temperature}) in {generate_seconds:.1f}s "
        f"({generated / generate_seconds:.0f} tokens/s)"
    )

    sequences = [list(c.prompt_token_ids) + list(c.token_ids) for c in completions]
    first_output = [len(c.prompt_token_ids) for c in completions]
    start = time.perf_counter()
    hidden = hidden_states(
        engine.params, config, sequences, engine.kernels, cache_dtype=engine.cache_config.dtype
    )
    hidden_seconds = time.perf_counter() - start
    total = sum(len(s) for s in sequences)
    print(f"hidden states of {total} positions in {hidden_seconds:.1f}s")

    start = time.perf_counter()
    heads, metrics = train_heads(
        engine.params, config, sequences, first_output, depth=args.depth, draft_vocab=args.draft_vocab,
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed,
        holdout_fraction=args.holdout_fraction, train_output=not args.freeze_output, hidden=hidden, log=_log,
    )  # fmt: skip
    train_seconds = time.perf_counter() - start
    print(f"trained in {train_seconds:.1f}s: {metrics['examples']['train']} examples")

    out = args.out or default_heads_dir(str(args.model))  # where `--speculative heads` looks
    info = {
        "model": model_name,
        "vocab_size": config.vocab_size,
        "quantization": runtime.model_info()["quantization"],
        "kv_cache_dtype": engine.cache_config.dtype,
        "examples": metrics["examples"]["train"],
        "prompts": len(prompts),
        "sampled_prompts": len(sampled),
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "generated_tokens": generated,
        "generate_seconds": round(generate_seconds, 1),
        "hidden_seconds": round(hidden_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "holdout": metrics["holdout"],
        "training": {k: v for k, v in metrics.items() if k != "holdout"},
    }
    save_heads(out, heads, info)
    print(f"saved to {out}")
    print("held-out metrics:", json.dumps(metrics["holdout"]))
    print("train-sample metrics:", json.dumps(metrics["train"]))


if __name__ == "__main__":
    main()
