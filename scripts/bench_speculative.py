"""What speculative decoding buys: decode tokens/s with drafts verified against the same engine without,
measured in one run, alternating.

    .venv/bin/python scripts/bench_speculative.py [--model smollm2-135m-instruct] [--num-draft-tokens N]
        [--max-tokens 256] [--repeats 3] [--draft-heads DIR] [--streams 16]
        [--draft-min-probability T | --compare-thresholds T1 T2 ...]

Workloads (scripts/speculation_prompts.py), greedy, the model's chat template:
  code edit, 1 stream, n-gram drafts: a module to return with a variable renamed (the answer repeats
      its context);
  chat, 1 stream, n-gram and draft heads (when heads exist for the model): ordinary questions the
      heads were not trained on, one at a time, all 16 by default. A prompt's ratio depends on the text
      the model answers with (how much of it the heads guess), and a change of a float's last bit
      anywhere in the model can change that text, so a few prompts say little: the geometric mean over
      all of them is the figure to compare;
  chat, --streams streams, the server's default drafter: the adaptive switch must keep speculation
      from slowing a batch down.
One engine serves both arms (the same programs, the same weights): `generate(..., speculation=None)`
decodes plainly, `speculation=config` drafts and verifies. Prints decode tokens/s (tokens after the
first over the time after the first), each arm's median over --repeats, the ratio, the acceptance
(accepted / drafted) and mean tokens per verification step, and whether the greedy tokens were equal.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from speculation_prompts import CHAT_PROMPTS, CODE_EDIT_PROMPT  # noqa: E402

from jaxinfer.cpu_kernels.native_build import cpu_description  # noqa: E402
from jaxinfer.generate import generate  # noqa: E402
from jaxinfer.request import SamplingParams, with_eos  # noqa: E402
from jaxinfer.runtime import RuntimeOptions, build_runtime  # noqa: E402
from jaxinfer.speculation.config import (  # noqa: E402
    SpeculativeMethod,
    draft_thresholds,
    min_probabilities,
    server_config,
)


def run(runtime, prompts, sampling, speculation):
    """(decode tokens/s over all streams, results, seconds)."""
    start = time.perf_counter()
    results = generate(runtime.engine, runtime.tokenizer, prompts, [sampling] * len(prompts),
                       speculation=speculation)  # fmt: skip
    wall = time.perf_counter() - start
    decode_tokens = sum(len(r.token_ids) - 1 for r in results)
    decode_time = max(r.ttft_s + r.tpot_s * (len(r.token_ids) - 1) for r in results) - min(
        r.ttft_s for r in results
    )
    return decode_tokens / max(decode_time, 1e-9), results, wall


def compare(runtime, name, prompts, sampling, speculation, repeats, settings=(None,)) -> list[dict]:
    """One workload, per repeat a plain run and then a speculative run per draft-threshold setting
    (None: the engine's own; others are set on the engine, which compiles nothing), so every setting
    meets the same phase of a drifting machine. A row per setting."""
    engine = runtime.engine
    kept = dict(engine.draft_min_probability)
    plain, runs = [], {t: dict(fast=[], same=True, drafted=0, accepted=0) for t in settings}
    for _ in range(repeats):
        rate, base, _ = run(runtime, prompts, sampling, None)
        plain.append(rate)
        for t in settings:
            if t is not None:
                engine.set_draft_min_probability(t)
            rate, spec, _ = run(runtime, prompts, sampling, speculation)
            r = runs[t]
            r["fast"].append(rate)
            r["same"] &= all(a.token_ids == b.token_ids for a, b in zip(base, spec))
            r["drafted"] += sum(x.num_draft_tokens for x in spec)
            r["accepted"] += sum(x.num_accepted_tokens for x in spec)
    if settings != (None,):  # put back what the engine drafted by
        for rows, values in kept.items():
            engine.set_draft_min_probability(values, rows)
    return [
        _row(name if t is None else f"{name}, thresholds {','.join(map(str, t))}", plain, r["fast"],
             r["same"], r["drafted"], r["accepted"])
        for t, r in runs.items()
    ]  # fmt: skip


def _row(name, plain, fast, same, drafted, accepted) -> dict:
    p, f = statistics.median(plain), statistics.median(fast)
    row = dict(
        workload=name, plain=p, speculative=f, ratio=f / p, acceptance=accepted / max(drafted, 1),
        drafted=drafted, accepted=accepted, same_tokens=same, plain_runs=plain, speculative_runs=fast,
    )  # fmt: skip
    print(
        f"{name:<34} plain {p:7.1f} tok/s   speculative {f:7.1f} tok/s   {f / p:5.2f}x   "
        f"acceptance {row['acceptance']:.2f} ({accepted}/{drafted})   same greedy tokens: {same}\n"
        f"{'':<34} runs: plain {[round(x, 1) for x in plain]}, speculative {[round(x, 1) for x in fast]}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--num-draft-tokens", type=int, default=None, help="default: default_num_draft_tokens()")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument(
        "--chat-prompts", type=int, default=len(CHAT_PROMPTS), help="one-stream chat prompts, one at a time"
    )
    ap.add_argument("--draft-heads", default=None)
    ap.add_argument(
        "--draft-min-probability", type=draft_thresholds, default=None,
        help="heads draft while their guess is at least this likely (per depth, comma-separated), or auto: "
        "chosen at warm-up (speculation/thresholds.py); default: SpeculationConfig's",
    )  # fmt: skip
    ap.add_argument(
        "--compare-thresholds", type=min_probabilities, nargs="+", default=None,
        help="instead of one setting: the chats with the heads at each of these per-depth thresholds "
        "(comma-separated), alternated in one process over shared plain runs",
    )  # fmt: skip
    ap.add_argument(
        "--crossover", type=int, nargs="*", default=None,
        help="instead: code edits at these stream counts with max_rows = streams, to find where verifying "
        "drafts stops paying (SpeculationConfig.max_rows; with --no-batch-gate, the raw effect)",
    )  # fmt: skip
    ap.add_argument(
        "--min-accepted", type=float, default=None,
        help="the adaptive pause's threshold (0: never pause, the drafters' raw effect); default: "
        "default_min_accepted()",
    )  # fmt: skip
    ap.add_argument(
        "--no-batch-gate", action="store_true",
        help="judge drafts per request only, not what verification steps cost a batch (BatchGate): the raw "
        "effect of verifying at each stream count",
    )  # fmt: skip
    args = ap.parse_args()

    print(cpu_description())
    config = server_config(
        SpeculativeMethod.NGRAM, num_draft_tokens=args.num_draft_tokens, min_accepted=args.min_accepted,
        draft_min_probability=args.draft_min_probability,
    )  # fmt: skip
    options = RuntimeOptions(
        model=args.model, quantize=args.quantize, num_slots=args.streams, speculation=config,
        draft_heads=args.draft_heads,
    )  # fmt: skip
    runtime = build_runtime(options)
    print(
        f"warm-up {runtime.engine.warmup():.1f} s; draft heads: {runtime.engine.draft_heads_depth or 'none'};"
        f" {config.num_draft_tokens} drafts per step, speculation up to {config.max_rows} decoding requests"
    )
    if runtime.engine.step_costs is not None:
        print(f"step costs (verification in plain steps): {runtime.engine.step_costs.summary()}")
    if runtime.engine.draft_heads_depth:
        chosen = runtime.engine.draft_min_probability.items()
        print("draft thresholds per depth: " + "; ".join(f"{rows} rows {t}" for rows, t in chosen))
    if args.no_batch_gate:
        runtime.engine.step_costs = None  # what the scheduler's batch gate weighs verification with
    tok = runtime.tokenizer
    sampling = with_eos(SamplingParams(temperature=0, max_tokens=args.max_tokens), tok.eos_ids)

    def chat(text: str) -> list[int]:
        if not tok.has_chat_template:  # a GGUF file without one (the packaged Gemma 3): the bare text
            return tok.encode(text)
        return tok.encode_chat([{"role": "user", "content": text}])

    if not tok.has_chat_template:
        print("the model has no chat template: prompts are the bare texts")

    if args.crossover:
        for n in args.crossover:
            forced = dataclasses.replace(config, max_rows=n)
            compare(runtime, f"code edit, {n} streams, ngram", [chat(CODE_EDIT_PROMPT)] * n, sampling, forced,
                    args.repeats)  # fmt: skip
        return
    rows = compare(runtime, "code edit, 1 stream, ngram", [chat(CODE_EDIT_PROMPT)], sampling, config,
                   args.repeats)  # fmt: skip
    methods = [SpeculativeMethod.NGRAM]

    def settings(method: SpeculativeMethod) -> tuple:
        """The draft thresholds a workload of `method` runs at (None: the engine's own)."""
        compared = method == SpeculativeMethod.HEADS and args.compare_thresholds
        return tuple(args.compare_thresholds) if compared else (None,)

    if runtime.engine.draft_heads_depth:
        methods.append(SpeculativeMethod.HEADS)
    for method in methods:
        spec = dataclasses.replace(config, method=method)
        for i, text in enumerate(CHAT_PROMPTS[: args.chat_prompts]):
            name = f"chat {i}, 1 stream, {method}"
            rows += compare(runtime, name, [chat(text)], sampling, spec, args.repeats, settings(method))
    many = [chat(t) for t in (CHAT_PROMPTS * args.streams)[: args.streams]]
    spec = dataclasses.replace(config, method=methods[-1])
    name = f"chat, {args.streams} streams, {methods[-1]}"
    rows += compare(runtime, name, many, sampling, spec, args.repeats, settings(methods[-1]))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["workload"].startswith("chat ") and ", 1 stream, " in r["workload"]:
            groups.setdefault(r["workload"].split(", 1 stream, ")[1], []).append(r)
    for group, chats in groups.items():
        print(f"chat, 1 stream, {group}: geometric mean ratio "
              f"{statistics.geometric_mean(r['ratio'] for r in chats):.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
