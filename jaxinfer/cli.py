"""The `jaxinfer` command: generate, models, convert (and the serving front ends).

User errors (unknown model, missing or corrupt file, bad sampling values, prompt too long) print one
line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

from jaxinfer.registry import DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotFoundError
from jaxinfer.speculation.config import DEFAULT_DRAFT_MIN_PROBABILITY, draft_thresholds, server_config

# quantization.QUANTIZATION_MODES, spelled out so that `jaxinfer --help` does not import jax
QUANTIZATION_MODES = ("none", "int8", "int4")

EXIT_USAGE = 2


class UserError(Exception):
    """A problem with what the user asked for, reported as one line."""


def _add_runtime_args(p: argparse.ArgumentParser, *, slots: int) -> None:
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="embedded model name, .gguf file, HF or orbax folder"
    )
    p.add_argument(
        "--dtype", default=None, help="weights/activations dtype (default: float32 on CPU, else bf16)"
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="KV cache dtype: float32, bfloat16, int8 (default: bfloat16 on CPU, else the activation dtype)",
    )
    p.add_argument(
        "--max-len", type=int, default=None,
        help="most positions one request may hold (default: the model's context); a cap, not a reservation",
    )  # fmt: skip
    p.add_argument(
        "--max-running", "--slots", dest="slots", type=int, default=slots,
        help="decode rows: most requests running at once (memory is --kv-cache-memory / --kv-pages)",
    )  # fmt: skip
    p.add_argument(
        "--kv-cache-memory", default=None,
        help="KV page pool size, e.g. 2GiB (default: CPU, every running request at full length, at most "
        "1GiB; TPU/GPU, half the device memory left after the weights)",
    )  # fmt: skip
    p.add_argument("--kv-pages", type=int, default=None, help="KV page pool size in pages (overrides memory)")
    p.add_argument(
        "--page-size", type=int, default=None, help="positions per KV page (default: 64 on CPU, else 16)"
    )
    p.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="do not reuse the KV pages of earlier requests' common prefixes",
    )  # fmt: skip
    p.add_argument("--max-prefill-chunk", type=int, default=512, help="largest prefill bucket")
    p.add_argument(
        "--mesh",
        default=None,
        help="device mesh, e.g. 'data=2,tensor=4' or 'expert=4,tensor=2' (default: one device)",
    )
    p.add_argument(
        "--quantize", default="auto", choices=["auto", *QUANTIZATION_MODES],
        help="weight quantisation; int4 repacks a GGUF file's 4- and 5-bit blocks as they are (its other "
        "tensors int8); auto on CPU: int4 for GGUF files of 4-bit linear weights where the native kernel "
        "runs, else int8; else none",
    )  # fmt: skip
    p.add_argument(
        "--weights-cache", default=None,
        help="folder for quantised weights converted from GGUF files (default ~/.cache/jaxinfer/weights, "
        "'' off)",
    )  # fmt: skip
    p.add_argument(
        "--int8-activations", action="store_true",
        help="with int8 weights, quantise activations at several rows too through XLA (int8 x int8 dots "
        "with the 8 largest channels in float), instead of the native kernel (or, without it, a bf16 "
        "weight copy for several rows)",
    )  # fmt: skip
    p.add_argument(
        "--attention-impl", default="auto", choices=["auto", "xla", "pallas", "native"],
        help="auto: Pallas kernels on TPU/GPU; on CPU the native C++ decode kernel where the CPU has "
        "AVX2 or AVX-512 (JAXINFER_NATIVE_KERNELS=0 turns the native kernels off), else XLA",
    )  # fmt: skip
    p.add_argument(
        "--compilation-cache", default=None,
        help="compiled-program cache folder ('' disables): serve and batch keep their programs there and "
        "load them without tracing; generate keeps XLA's persistent cache there",
    )  # fmt: skip
    p.add_argument(
        "--speculative", default="off", choices=["off", "ngram", "heads"],
        help="speculative decoding: draft tokens by prompt lookup (ngram) or by draft heads on the model's "
        "hidden state where prompt lookup finds nothing (heads), verified by the model in one step; a "
        "request may pick another or 'off'",
    )  # fmt: skip
    p.add_argument(
        "--num-draft-tokens", type=int, default=None,
        help="drafts verified per step and request; default: measured on this backend, 4 with AVX-512 "
        "VNNI kernels and on accelerators, 2 on AVX2-only CPUs",
    )  # fmt: skip
    p.add_argument(
        "--speculative-max-rows", type=int, default=None,
        help="speculate only while at most this many requests decode (past it a step is no longer bound "
        "by reading the weights and drafts stop paying); default: the crossover measured on this "
        "backend, 4 with AVX-512 VNNI kernels and on accelerators, 1 with AVX-VNNI or AVX2 alone",
    )  # fmt: skip
    p.add_argument("--draft-heads", default=None, help="draft heads folder (scripts/train_draft_heads.py)")
    p.add_argument(
        "--draft-min-probability", type=draft_thresholds, default=None,
        help="draft heads draft while their guess is at least this likely: one value, or one per depth "
        "(comma-separated; the last holds for deeper drafts), or auto: chosen at warm-up from the heads' "
        "held-out drafts and this machine's step costs; default "
        + ",".join(map(str, DEFAULT_DRAFT_MIN_PROBABILITY)),
    )  # fmt: skip


_MODEL_DEFAULT = " (default: the model's recommended value, else %(off)s)"


def _add_sampling_args(p: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """Unset flags take the model's recommended values (request.py); the flags are request fields."""
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, help="0 is greedy" + _MODEL_DEFAULT % {"off": "1"})
    p.add_argument("--top-p", type=float, help=_MODEL_DEFAULT % {"off": "1, off"})
    p.add_argument("--top-k", type=int, help=_MODEL_DEFAULT % {"off": "0, off"})
    p.add_argument("--min-p", type=float, help=_MODEL_DEFAULT % {"off": "0, off"})
    p.add_argument("--repetition-penalty", type=float, help=_MODEL_DEFAULT % {"off": "1, off"})
    p.add_argument("--presence-penalty", type=float)
    p.add_argument("--frequency-penalty", type=float)
    p.add_argument("--seed", type=int, help="default: a random seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--logprobs", type=int, help="return log-probabilities with this many alternatives (json)")


_SAMPLING_FLAGS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seed", "stop", "ignore_eos", "logprobs",
)  # fmt: skip


def _sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling flags the user set, by request.py's field names."""
    return {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}


def _runtime_options(args: argparse.Namespace, *, program_cache: bool = False):
    from jaxinfer.runtime import RuntimeOptions, parse_memory_size
    from jaxinfer.sharding import parse_mesh

    kwargs = {}
    if args.kv_cache_memory is not None:
        try:
            kwargs["kv_cache_memory"] = parse_memory_size(args.kv_cache_memory)
        except ValueError as e:
            raise UserError(str(e)) from e
    if args.compilation_cache is not None:
        kwargs["compilation_cache_dir"] = args.compilation_cache or None
    if args.weights_cache is not None:
        kwargs["weights_cache_dir"] = args.weights_cache or None
    if args.speculative != "off":
        try:
            kwargs["speculation"] = server_config(
                args.speculative, num_draft_tokens=args.num_draft_tokens, max_rows=args.speculative_max_rows,
                draft_min_probability=args.draft_min_probability,
            )  # fmt: skip
        except ValueError as e:
            raise UserError(str(e)) from e
    return RuntimeOptions(
        model=args.model,
        dtype=args.dtype,
        cache_dtype=args.kv_cache_dtype,
        num_slots=args.slots,
        max_len=args.max_len,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        enable_prefix_caching=args.prefix_caching,
        max_prefill_chunk=args.max_prefill_chunk,
        mesh=parse_mesh(args.mesh) if args.mesh else None,
        quantize=args.quantize,
        int8_activations=args.int8_activations,
        attention_impl=args.attention_impl,
        draft_heads=args.draft_heads,
        program_cache=program_cache,
        **kwargs,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from jaxinfer.generate import generate
    from jaxinfer.request import check_request, encode_prompt, parse_sampling
    from jaxinfer.runtime import build_runtime

    fields = _sampling_fields(args)
    parse_sampling(fields).validate()  # a bad flag fails before the model loads
    if args.slots is None:
        args.slots = max(1, len(args.prompt))
    runtime = build_runtime(_runtime_options(args))
    sampling = parse_sampling(fields, defaults=runtime.sampling_defaults)
    tok = runtime.tokenizer
    prompts = []
    for text in args.prompt:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": text}
            ]
            prompts.append(encode_prompt(tok, messages=messages))
        else:
            prompts.append(encode_prompt(tok, prompt=text))
    stream = args.output == "text" and len(prompts) == 1

    def on_text(index: int, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    for ids in prompts:
        # before compiling anything for them
        check_request(ids, sampling, vocab_size=tok.vocab_size, max_seq_len=runtime.engine.max_seq_len)
    compile_s = runtime.engine.warmup([len(p) for p in prompts], sampling.max_tokens)
    start = time.perf_counter()
    results = generate(
        runtime.engine, tok, prompts, [sampling] * len(prompts), on_text=on_text if stream else None,
        enable_prefix_caching=args.prefix_caching, speculation=runtime.options.speculation,
    )  # fmt: skip
    wall = time.perf_counter() - start
    info = runtime.model_info()
    weights = {key: info[key] for key in ("quantization", "weight_bytes", "float32_weight_bytes")}
    for text, r in zip(args.prompt, results):
        if args.output == "json":
            print(json.dumps({"prompt": text, **r.to_json(), "weights": weights}, ensure_ascii=False))
        elif stream:
            print()
        else:
            print(f"=== {text}\n{r.text}\n")
    if args.output == "text":
        r = results[0]
        print(
            f"[{runtime.config.arch}: {len(r.prompt_token_ids)} prompt tokens, {len(r.token_ids)} generated "
            f"({r.finish_reason}, seed {sampling.seed}); TTFT {r.ttft_s * 1e3:.0f} ms, "
            f"{r.decode_tokens_per_s:.1f} tok/s decode; "
            f"load {runtime.load_seconds:.1f}s, compile {compile_s:.1f}s, generate {wall:.1f}s]",
            file=sys.stderr,
        )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    for name, m in EMBEDDED_MODELS.items():
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}\t{m.description}\tpackage: {m.package}")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from jaxinfer.loading import load_gguf, load_model, save_checkpoint
    from jaxinfer.loading.sampling_defaults import sampling_defaults
    from jaxinfer.quantization import quantize_params, weight_bytes
    from jaxinfer.runtime import load_tokenizer

    loaded = load_model(args.model, dtype=args.dtype or "float32")
    tokenizer = load_tokenizer(loaded)
    out = os.path.abspath(args.output)
    before = weight_bytes(loaded.params)
    clips, how = None, ""
    if args.quantize == "int4" and loaded.kind == "gguf":
        # The file's own 4- and 5-bit blocks, repacked; its wider tensors int8 (as the runtime loads it).
        blocks = load_gguf(loaded.path, dtype=args.dtype or "float32", int4=True)
        params = quantize_params(blocks.params, "int8")
        how = ", the GGUF file's 4- and 5-bit blocks as they are"
    else:
        if args.quantize == "int4" and args.calibration_steps > 0:
            from jaxinfer.int4_calibration import CALIBRATION_TEXT, calibrate_int4

            tokens = tokenizer.encode(CALIBRATION_TEXT)
            clips, fits = calibrate_int4(
                loaded.params, loaded.config, tokens, group_size=args.group_size, steps=args.calibration_steps
            )
            gain = sum(f.rtn_error for f in fits) / max(sum(f.calibrated_error for f in fits), 1e-30)
            how = f", clipping calibrated with optax (layer output error {gain:.2f}x below round-to-nearest)"
        params = quantize_params(loaded.params, args.quantize, group_size=args.group_size, clips=clips)
    defaults = sampling_defaults(args.model, loaded.kind, loaded.path)
    extra = {"source": str(loaded.path), "kind": loaded.kind, "sampling_defaults": defaults.to_json()}
    save_checkpoint(out, loaded.config, params, extra=extra)
    tokenizer.save(os.path.join(out, "tokenizer"))
    print(
        f"wrote {loaded.config.arch} checkpoint ({loaded.config.num_layers} layers, weights "
        f"{args.quantize}{how}: {before / 2**20:.1f} MiB -> {weight_bytes(params) / 2**20:.1f} MiB) "
        f"to {out}"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from jaxinfer import multihost
    from jaxinfer.client import api_key_or_env
    from jaxinfer.orchestrator import Orchestrator
    from jaxinfer.runtime import build_runtime
    from jaxinfer.service import TlsFiles, serve_forever

    log = logging.getLogger("jaxinfer.serve")
    api_key = api_key_or_env(args.api_key)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UserError("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert is not None:
        for path in (args.tls_cert, args.tls_key):
            if not os.path.isfile(path):
                raise UserError(f"no such file: {path}")
        tls = TlsFiles(args.tls_cert, args.tls_key)
    cluster = None
    if args.coordinator:
        # Before anything touches a device: every process must join the cluster first.
        cluster = multihost.initialize(args.coordinator, args.num_processes, args.process_id)
    options = _runtime_options(args, program_cache=True)
    if cluster is not None and options.mesh is None:
        options = dataclasses.replace(options, mesh=multihost.default_mesh_shape())
    runtime = build_runtime(options)

    def lead(engine) -> int:
        seconds = engine.warmup()
        log.warning(
            "warm-up prepared %d programs (%d loaded from the program cache) in %.1fs (load %.1fs); nothing "
            "compiles while serving",
            runtime.engine.compile_count, runtime.engine.loaded_count, seconds, runtime.load_seconds,
        )  # fmt: skip
        orchestrator = Orchestrator(
            engine, runtime.tokenizer, max_queue=args.max_queue,
            enable_prefix_caching=options.enable_prefix_caching, speculation=options.speculation,
        )  # fmt: skip
        info = runtime.model_info()
        return serve_forever(
            orchestrator, runtime.tokenizer, info, grace_s=args.grace,
            host=args.host, port=args.port, metrics_port=args.metrics_port, http_port=args.http_port,
            api_key=api_key, tls=tls, sampling_defaults=runtime.sampling_defaults,
        )  # fmt: skip

    if cluster is None:
        return lead(runtime.engine)
    try:
        # Process 0 serves and broadcasts every engine call; the others replay them in lockstep.
        return multihost.run(cluster, runtime.engine, lead) or 0
    finally:
        multihost.shutdown()


def cmd_batch(args: argparse.Namespace) -> int:
    from jaxinfer.batch import run_batch
    from jaxinfer.request import parse_sampling
    from jaxinfer.runtime import build_runtime

    fields = _sampling_fields(args)
    parse_sampling(fields).validate()  # a bad flag fails before the model loads
    if not os.path.exists(args.input):
        raise UserError(f"no such input file: {args.input}")
    runtime = build_runtime(_runtime_options(args, program_cache=True))
    if not args.no_warmup:
        runtime.engine.warmup()  # compile every bucket now, so the progress bar's rate and ETA hold
    summary = run_batch(
        runtime.engine, runtime.tokenizer, args.input, args.output,
        base_fields=fields, sampling_defaults=runtime.sampling_defaults, strict=args.strict,
        max_queue=args.max_queue, progress=not args.no_progress, speculation=runtime.options.speculation,
    )  # fmt: skip
    print(summary.format(), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary.to_json(), f, indent=2)
    return 1 if summary.num_failed else 0


def cmd_bench_serving(args: argparse.Namespace) -> int:
    from jaxinfer.bench_serving import main_from_args

    return main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxinfer", description="LLM inference on JAX/XLA")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for prompts")
    _add_runtime_args(g, slots=None)
    _add_sampling_args(g, max_tokens=128)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--output", choices=["text", "json"], default="text")
    g.add_argument("prompt", nargs="+")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the embedded models")
    m.set_defaults(func=cmd_models)

    sv = sub.add_parser("serve", help="serve the model over gRPC with continuous batching")
    _add_runtime_args(sv, slots=8)
    sv.add_argument("--host", default="0.0.0.0")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics HTTP port")
    sv.add_argument(
        "--http-port", type=int, default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions ...) on this port too",
    )  # fmt: skip
    sv.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' (HTTP) / authorization metadata (gRPC); default: "
        "$JAXINFER_API_KEY, else none",
    )  # fmt: skip
    sv.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    sv.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    sv.add_argument("--max-queue", type=int, default=64, help="waiting requests before RESOURCE_EXHAUSTED")
    sv.add_argument("--grace", type=float, default=10.0, help="seconds to finish streams on SIGTERM")
    sv.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 for multi-host serving")
    sv.add_argument("--num-processes", type=int, default=None, help="processes in the cluster")
    sv.add_argument("--process-id", type=int, default=None, help="this process's rank (0 serves gRPC)")
    sv.set_defaults(func=cmd_serve)

    # Listed for --help; main() hands `client ...` to jaxinfer.client.client_main before parsing.
    sub.add_parser("client", help="stream a completion from a server (jaxinfer client --help)")

    bt = sub.add_parser("batch", help="offline generation from a JSONL file into a JSONL file (resumable)")
    _add_runtime_args(bt, slots=8)
    _add_sampling_args(bt, max_tokens=None)
    bt.add_argument("input", help="JSONL: one {id, prompt | messages, [max_tokens, sampling...]} per line")
    bt.add_argument("output", help="JSONL results; ids already in it are skipped (resume)")
    bt.add_argument("--strict", action="store_true", help="a bad input line stops the run (exit 2)")
    bt.add_argument("--max-queue", type=int, default=64, help="requests submitted ahead of the slots")
    bt.add_argument("--no-progress", action="store_true", help="no progress bar")
    bt.add_argument("--no-warmup", action="store_true", help="compile lazily instead of before the run")
    bt.add_argument("--summary-json", default=None, help="also write the summary to this JSON file")
    bt.set_defaults(func=cmd_batch)

    from jaxinfer.bench_serving import add_bench_serving_args

    bs = sub.add_parser("bench-serving", help="load-test a running server; latency and throughput report")
    add_bench_serving_args(bs)
    bs.set_defaults(func=cmd_bench_serving)

    c = sub.add_parser("convert", help="write a model as an orbax checkpoint folder")
    c.add_argument("--model", default=DEFAULT_MODEL)
    c.add_argument("--dtype", default=None)
    c.add_argument(
        "--quantize", default="none", choices=QUANTIZATION_MODES, help="store int8 or int4 weights"
    )
    c.add_argument("--group-size", type=int, default=32, choices=[32, 128], help="int4 inputs per scale")
    c.add_argument(
        "--calibration-steps", type=int, default=80,
        help="int4 from float weights: Adam steps per layer fitting the clipping ranges (0: nearest)",
    )  # fmt: skip
    c.add_argument("output")
    c.set_defaults(func=cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        # The client has its own parser; argparse's REMAINDER would stop at its first --option.
        from jaxinfer.client import client_main

        return client_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from jaxinfer.jit_mappings import MappingLimitError
    from jaxinfer.loading import ModelLoadError

    try:
        return args.func(args)
    except (
        UserError, ValueError, ModelLoadError, ModelNotFoundError, FileNotFoundError, MappingLimitError
    ) as e:  # fmt: skip
        print(f"jaxinfer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
