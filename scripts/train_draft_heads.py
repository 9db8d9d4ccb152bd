"""Trains draft heads for speculative decoding on text the target model generates itself.

    .venv/bin/python scripts/train_draft_heads.py [--model smollm2-135m-instruct] [--prompts 666]
        [--samples-per-prompt 4] [--max-tokens 256] [--steps 4800] [--soft-weight 1.0] [--corpus FILE]
        [--out DIR]

1. builds the runtime as `jaxinfer generate` would (--quantize auto: the weights the engine serves);
2. answers the first --prompts of speculation_prompts.TRAINING_PROMPTS with the target itself, 48 at a
   time, --samples-per-prompt answers each: the first greedy, the others at temperature 0.8 (the
   heads keep learning from more of the model's own text; sampling varies it); with --corpus, the
   answers are written to FILE, or read from it when it exists (training again skips generating), and
   a FILE answering fewer prompts is extended with the answers to the rest;
3. runs the engine's own params and kernels over every prompt + answer once for the hidden states, the
   target's greedy choice at each position (the labels: what greedy verification accepts) and, for
   --soft-weight > 0, its top 16 choices with their probabilities;
4. fits the heads (speculation/training.py; prompts held out whole), by default distilled on the
   target's distribution over those choices (held out, they accept more drafts than heads fitted to the
   greedy choices alone), and saves those of the best held-out checkpoint with their metrics to --out
   (default $JAXINFER_CACHE_DIR/draft_heads/<model>, ~/.cache/jaxinfer/draft_heads/<model> without it),
   with a sample of their held-out drafts, from which a server picks its draft thresholds
   (speculation/thresholds.py).

Prints each phase's wall time and the held-out metrics: top-1 accuracy per depth (teacher-forced) and
the expected drafts accepted per step under greedy verification.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from speculation_prompts import DEFAULT_TRAINING_PROMPTS, TRAINING_PROMPTS

from jaxinfer.generate import generate
from jaxinfer.registry import DEFAULT_MODEL
from jaxinfer.request import SamplingParams, with_eos
from jaxinfer.runtime import RuntimeOptions, build_runtime, default_heads_dir
from jaxinfer.speculation.draft_heads import save_heads
from jaxinfer.speculation.training import hidden_states, teacher_top_k, train_heads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantize", default="auto", choices=["auto", "none", "int8", "int4"])
    p.add_argument(
        "--prompts", type=int, default=DEFAULT_TRAINING_PROMPTS,
        help=f"training prompts (at most {len(TRAINING_PROMPTS)}: the conversational set after the first)",
    )  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=256, help="tokens generated per answer")
    p.add_argument(
        "--samples-per-prompt", type=int, default=4,
        help="answers per prompt: the first greedy (or sampled, per --sampled-share), the rest sampled",
    )  # fmt: skip
    p.add_argument("--slots", type=int, default=48, help="requests generated at once")
    p.add_argument(
        "--sampled-share", type=float, default=0.0, help="share of prompts whose first answer is sampled too"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the sampled answers")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4800)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument(
        "--soft-weight", type=float, default=1.0,
        help="weight of the loss against the target's top choices (distillation; the rest: its greedy one)",
    )  # fmt: skip
    p.add_argument("--freeze-output", action="store_true", help="keep the target's output rows as they are")
    p.add_argument("--holdout-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--corpus", type=Path,
        help="JSON file of the generated answers: read if it exists (extended to --prompts), else written",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="default: $JAXINFER_CACHE_DIR/draft_heads/<model>")
    args = p.parse_args()
    try:
        teacher_top_k(args.soft_weight)  # refused before the long generation, not after it
    except ValueError as error:
        p.error(str(error))
    return args


def _log(line: str) -> None:
    print(f"  {line}", flush=True)


def _generate_corpus(args: argparse.Namespace, runtime, model_name: str, first: int = 0) -> dict:
    """The target's answers to training prompts first .. --prompts: each sequence (prompt + answer),
    where its answer starts, and its prompt's index (answers to one prompt are held out together)."""
    tokenizer = runtime.tokenizer
    encoded = [
        tokenizer.encode_chat([{"role": "user", "content": text}])
        for text in TRAINING_PROMPTS[: args.prompts]
    ]
    sampled_first = set(
        np.random.default_rng(args.seed).permutation(len(encoded))[: round(args.sampled_share * len(encoded))]
    )
    prompts, groups, sampling = [], [], []  # groups: each answer's prompt (held out together)
    for i, prompt in enumerate(encoded[first:], start=first):
        for answer in range(args.samples_per_prompt):
            sampled = answer > 0 or i in sampled_first
            prompts.append(prompt)
            groups.append(i)
            sampling.append(with_eos(SamplingParams(
                temperature=args.temperature if sampled else 0.0, max_tokens=args.max_tokens,
                seed=args.seed + i * args.samples_per_prompt + answer,
            ), tokenizer.eos_ids))  # fmt: skip
    num_sampled = sum(s.temperature > 0 for s in sampling)
    start = time.perf_counter()
    completions = generate(runtime.engine, tokenizer, prompts, sampling)
    generate_seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for c in completions)
    print(
        f"generated {generated} tokens for {len(encoded) - first} prompts ({len(prompts)} answers, "
        f"{num_sampled} sampled at temperature {args.temperature}) in {generate_seconds:.1f}s "
        f"({generated / generate_seconds:.0f} tokens/s)"
    )
    return {
        "model": model_name,
        "prompts": len(encoded),
        "answers": len(prompts),
        "sampled_answers": num_sampled,
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
        "generated_tokens": generated,
        "generate_seconds": round(generate_seconds, 1),
        "sequences": [list(c.prompt_token_ids) + list(c.token_ids) for c in completions],
        "first_output": [len(c.prompt_token_ids) for c in completions],
        "groups": groups,
    }


def _check_extendable(corpus: dict, args: argparse.Namespace) -> None:
    """Exits unless the answers to more prompts would be generated as `corpus`'s were."""
    settings = {
        "temperature": corpus["temperature"], "max_tokens": corpus["max_tokens"],
        "samples_per_prompt": corpus["answers"] // corpus["prompts"],
    }  # fmt: skip
    if any(value != getattr(args, k) for k, value in settings.items()):
        raise SystemExit(
            f"{args.corpus} was generated with " + ", ".join(f"{k} {v}" for k, v in settings.items())
            + "; extend it with the same settings"
        )  # fmt: skip


def _extended(corpus: dict, more: dict) -> dict:
    """`corpus` followed by `more`, the answers to the prompts after its own."""
    summed = ("answers", "sampled_answers", "generated_tokens", "generate_seconds")
    listed = ("sequences", "first_output", "groups")
    return {
        **corpus,
        "prompts": more["prompts"],
        **{k: round(corpus[k] + more[k], 1) for k in summed},
        **{k: corpus[k] + more[k] for k in listed},
    }


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    runtime = build_runtime(
        RuntimeOptions(model=args.model, quantize=args.quantize, num_slots=args.slots, max_len=1024)
    )
    engine, config = runtime.engine, runtime.config
    model_name = runtime.model_info()["model_name"]
    load_seconds = time.perf_counter() - start
    print(f"loaded {model_name} ({runtime.model_info()['quantization']}) in {load_seconds:.1f}s")

    corpus = None
    if args.corpus is not None and args.corpus.exists():
        corpus = json.loads(args.corpus.read_text())
        if corpus["model"] != model_name:
            raise SystemExit(f"{args.corpus} holds answers of {corpus['model']}, not {model_name}")
        print(f"read {corpus['generated_tokens']} generated tokens ({len(corpus['sequences'])} answers) "
              f"from {args.corpus}")  # fmt: skip
    if corpus is None or corpus["prompts"] < args.prompts:
        if corpus is not None:
            _check_extendable(corpus, args)
        more = _generate_corpus(args, runtime, model_name, first=0 if corpus is None else corpus["prompts"])
        corpus = more if corpus is None else _extended(corpus, more)
        if args.corpus is not None:
            args.corpus.write_text(json.dumps(corpus))
    sequences, first_output, groups = corpus["sequences"], corpus["first_output"], corpus["groups"]

    start = time.perf_counter()
    hidden, choices, logprobs = hidden_states(
        engine.params, config, sequences, engine.kernels, cache_dtype=engine.cache_config.dtype,
        top_k=teacher_top_k(args.soft_weight),
    )  # fmt: skip
    greedy = [c[:, 0] for c in choices]
    hidden_seconds = time.perf_counter() - start
    total = sum(len(s) for s in sequences)
    # How often an answer's next token is the target's greedy choice: its sampled answers leave that path.
    same = sum(
        int(np.sum(np.asarray(s[f:]) == g[f - 1 : -1])) for s, g, f in zip(sequences, greedy, first_output)
    )
    answered = sum(len(s) - f for s, f in zip(sequences, first_output))
    print(f"hidden states of {total} positions in {hidden_seconds:.1f}s; {same / max(answered, 1):.1%} of "
          "the answers' tokens are the target's greedy choice")  # fmt: skip

    start = time.perf_counter()
    heads, metrics = train_heads(
        engine.params, config, sequences, first_output, depth=args.depth, draft_vocab=args.draft_vocab,
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate, seed=args.seed,
        holdout_fraction=args.holdout_fraction, groups=groups, train_output=not args.freeze_output,
        hidden=hidden, labels=greedy, teacher=list(zip(choices, logprobs)), soft_weight=args.soft_weight,
        log=_log,
    )  # fmt: skip
    train_seconds = time.perf_counter() - start
    held_out = metrics.pop("held_out_drafts")
    print(f"trained in {train_seconds:.1f}s: {metrics['examples']['train']} examples")

    out = args.out or default_heads_dir(str(args.model))  # where `--speculative heads` looks
    info = {
        "model": model_name,
        "vocab_size": config.vocab_size,
        "quantization": runtime.model_info()["quantization"],
        "kv_cache_dtype": engine.cache_config.dtype,
        "examples": metrics["examples"]["train"],
        **{k: v for k, v in corpus.items() if k not in ("sequences", "first_output", "groups")},
        "hidden_seconds": round(hidden_seconds, 1),
        "train_seconds": round(train_seconds, 1),
        "holdout": metrics["holdout"],
        "training": {k: v for k, v in metrics.items() if k != "holdout"},
    }
    save_heads(out, heads, info)
    held_out.save(out)  # the serving engine chooses its draft thresholds from these (thresholds.py)
    print(f"saved to {out}")
    print("held-out metrics:", json.dumps(metrics["holdout"]))
    print("train-sample metrics:", json.dumps(metrics["train"]))


if __name__ == "__main__":
    main()
