"""What structured output costs: decode time per output token with every stream under a JSON Schema,
against the same streams unconstrained, measured in one run.

    .venv/bin/python scripts/bench_structured_output.py [--model smollm2-135m-instruct] [--streams 16]
        [--max-tokens 96] [--repeats 3]

Both runs drive the same `generate` loop (the server's scheduler) with the same prompts, greedy, to
--max-tokens tokens (ignore_eos). The schema is an array of short strings that never has to end, so
every constrained stream decodes as many tokens as an unconstrained one. A constrained step pays for
the grammar (llguidance computes each stream's mask on the host), the mask (copied to the device and
applied to the logits) and a serving loop that reads each step before planning the next (a mask needs
the last token), which an unconstrained run overlaps with the device. Prints TPOT (the median over
--repeats runs of the mean decode time per token after the first) and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jaxinfer.cpu_kernels.native_build import cpu_description
from jaxinfer.generate import generate
from jaxinfer.request import SamplingParams, StructuredKind, StructuredOutput
from jaxinfer.runtime import RuntimeOptions, build_runtime

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 2000}},
    "required": ["story"],
    "additionalProperties": False,
}
PROMPT = 'Tell a long story, as JSON: {"story": "..."}.'


def tpot_ms(runtime, prompts, sampling) -> tuple[float, list]:
    start = time.perf_counter()
    results = generate(runtime.engine, runtime.tokenizer, prompts, [sampling] * len(prompts))
    wall = time.perf_counter() - start
    tpot = statistics.mean(r.tpot_s for r in results) * 1e3
    assert all(len(r.token_ids) == sampling.max_tokens for r in results), "a stream ended early"
    return tpot, results, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(cpu_description())
    runtime = build_runtime(RuntimeOptions(model=args.model, num_slots=args.streams, max_len=512))
    tok = runtime.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"{PROMPT} ({i})"}]) for i in range(args.streams)]
    runtime.engine.warmup([len(p) for p in prompts], args.max_tokens)
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0,
        structured_output=StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    )  # fmt: skip
    tpot_ms(runtime, prompts, plain)  # the first run pays one-time costs (program first runs)
    rows = {"unconstrained": [], "json_schema": []}
    sample = None
    for _ in range(args.repeats):
        rows["unconstrained"].append(tpot_ms(runtime, prompts, plain)[0])
        t, results, _ = tpot_ms(runtime, prompts, constrained)
        rows["json_schema"].append(t)
        sample = results[0].text
    base = statistics.median(rows["unconstrained"])
    print(f"{args.model}, {args.streams} streams, {args.max_tokens} tokens each, greedy")
    for name, values in rows.items():
        median = statistics.median(values)
        print(f"  {name:14s} TPOT {median:7.2f} ms (runs: {', '.join(f'{v:.2f}' for v in values)})  "
              f"x{median / base:.3f}")  # fmt: skip
    print(f"  a constrained output begins: {sample[:80]!r}")


if __name__ == "__main__":
    main()
