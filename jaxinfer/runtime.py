"""Assembles a ready engine from user-level options: model, tokenizer, mesh, cache, compilation cache.

Shared by every front end (`generate`, `serve`, `batch`, benchmarks) so each option means the same thing
everywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shutil
import time
from pathlib import Path

import jax

from jaxinfer import program_cache
from jaxinfer.config import CacheConfig, KernelConfig, ModelConfig
from jaxinfer.cpu_kernels import int4_matmul_available
from jaxinfer.jax_engine import JaxEngine
from jaxinfer.kernel_dispatch import native_attention_min_rows
from jaxinfer.kv_cache import bytes_per_page
from jaxinfer.loading import LoadedModel, ModelLoadError, load_gguf, load_model
from jaxinfer.loading.common import expected_leaf_shapes
from jaxinfer.loading.gguf_loader import linear_weights_are_4bit, open_gguf
from jaxinfer.loading.orbax_checkpoint import MODEL_FILE
from jaxinfer.loading.sampling_defaults import sampling_defaults
from jaxinfer.models.params import fuse_projections
from jaxinfer.quantization import (
    add_bf16_copies,
    add_vnni_weights,
    int5_as_int8,
    pack_int4_weights,
    quantization_of,
    quantize_params,
    weight_bytes,
)
from jaxinfer.registry import DEFAULT_MODEL, EMBEDDED_MODELS, resolve_model
from jaxinfer.request import ModelDefaults
from jaxinfer.sharding import TENSOR, make_mesh, param_placement
from jaxinfer.speculation.config import AUTO, SpeculationConfig, SpeculativeMethod
from jaxinfer.speculation.draft_heads import HEADS_FILE, DraftHeads, load_heads
from jaxinfer.speculation.thresholds import HeldOutDrafts
from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CACHE_ROOT = Path(os.environ.get("JAXINFER_CACHE_DIR", Path.home() / ".cache" / "jaxinfer"))
DEFAULT_COMPILATION_CACHE = CACHE_ROOT / "xla"
DEFAULT_WEIGHTS_CACHE = CACHE_ROOT / "weights"
DEFAULT_DRAFT_HEADS = CACHE_ROOT / "draft_heads"


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    model: str = DEFAULT_MODEL
    # None picks per backend: float32 on CPU (one-row bf16 matmuls are ~10x slower on XLA:CPU), else bf16.
    dtype: str | None = None
    cache_dtype: str | None = None
    num_slots: int = 8  # decode rows: most requests running at once (--max-running)
    # Most positions one request may hold; None: the model's context. A cap, not a reservation.
    max_len: int | None = None
    # The KV page pool: page_size positions per page (None: default_page_size), sized by kv_pages, else
    # by kv_cache_memory bytes, else by default_kv_cache_memory.
    page_size: int | None = None
    kv_pages: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    max_prefill_chunk: int = 512
    mesh: dict[str, int] | None = None
    # "int8" / "int4": weights quantised once at load (quantization.py); "auto": resolve_quantize
    quantize: str = "none"
    # int8 weights at several rows: quantise activations per row through XLA's int8 x int8 dots. Off by
    # default: on CPU the VNNI kernel (activations in blocks of 32) or, without it, a bf16 weight copy
    # serves several rows faster and more accurately (quantization.py).
    int8_activations: bool = False
    attention_impl: str = "auto"  # auto | xla | pallas | native
    compilation_cache_dir: str | None = str(DEFAULT_COMPILATION_CACHE)
    # Keep the engine's compiled programs there instead and load them without tracing (program_cache):
    # for entry points that warm every bucket up at start (serve, batch). JAX's own cache, keyed by the
    # traced program, is then off: its executables do not serialize whole.
    program_cache: bool = False
    # int8 weights converted from a GGUF file are kept here (an orbax checkpoint per file), so a later
    # start skips parsing and dequantising the file. None or '' disables.
    weights_cache_dir: str | None = str(DEFAULT_WEIGHTS_CACHE)
    # Speculative decoding (None: off, and requests may not ask for it); draft_heads: a folder of heads
    # trained for this model (scripts/train_draft_heads.py), default DEFAULT_DRAFT_HEADS / model name.
    speculation: SpeculationConfig | None = None
    draft_heads: str | None = None


@dataclasses.dataclass
class Runtime:
    engine: JaxEngine
    tokenizer: Tokenizer
    model: LoadedModel
    options: RuntimeOptions
    load_seconds: float
    sampling_defaults: ModelDefaults = dataclasses.field(default_factory=ModelDefaults)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def model_info(self) -> dict:
        c, cache = self.config, self.engine.cache_config
        return {
            # What clients name the model (OpenAI's `model` field): an embedded model's registry name,
            # else the checkpoint's own name or its path.
            "model_name": model if (model := str(self.options.model)) in EMBEDDED_MODELS else c.name or model,
            "architecture": c.arch,
            "context_length": cache.max_len,
            "vocab_size": c.vocab_size,
            "num_slots": cache.num_slots,
            "page_size": cache.page_size,
            "num_kv_pages": cache.num_usable_pages,
            "kv_cache_dtype": cache.dtype,
            "prefix_caching": self.options.enable_prefix_caching,
            "mesh": dict(self.engine.mesh.shape),
            "dtype": default_dtype(self.options.dtype),
            "quantization": quantization_of(self.model.params),
            **self.weight_memory(),
        }

    def weight_memory(self) -> dict[str, int]:
        """Bytes the engine's weights hold (every array, kernel layouts included) and the float32 bytes
        of the same parameters."""
        parameters = sum(math.prod(shape) for shape in expected_leaf_shapes(self.config).values())
        return {"weight_bytes": weight_bytes(self.engine.params), "float32_weight_bytes": 4 * parameters}


def default_dtype(dtype: str | None) -> str:
    if dtype is not None:
        return dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def default_cache_dtype(cache_dtype: str | None, dtype: str) -> str:
    """bfloat16 on CPU: half the cache memory, and decode of many slots reads half the bytes (a SmolLM2
    step at 16 slots takes a sixth less time) with the float model's greedy tokens as often as a float32 cache
    (decoding 16 rows: SmolLM2 91.2% both, Gemma 96.3% vs 95.3%; docs/benchmarks.md). Elsewhere the
    activations' dtype."""
    if cache_dtype is not None:
        return cache_dtype
    return "bfloat16" if jax.default_backend() == "cpu" else dtype


# Positions per KV page. CPU: 16-position pages decoded measurably slower, 32 to 256 alike
# (docs/benchmarks.md); 64 keeps page tables and page buckets short at 8k contexts. TPU/GPU: 16, as
# tpu-inference and vLLM use; finer prefix sharing at a small kernel cost.
DEFAULT_PAGE_SIZE = {"cpu": 64}
ACCELERATOR_PAGE_SIZE = 16
# CPU: KV memory for every running request at full length, at most 1 GiB (SmolLM2 in bfloat16: ~45k
# positions). TPU/GPU: this share of the device memory left after the weights.
CPU_KV_CACHE_MEMORY = 1 << 30
ACCELERATOR_KV_CACHE_FRACTION = 0.5


def default_page_size(page_size: int | None, backend: str) -> int:
    return page_size or DEFAULT_PAGE_SIZE.get(backend, ACCELERATOR_PAGE_SIZE)


def default_kv_cache_memory(backend: str, needed: int) -> int:
    """Bytes for the page pool when neither --kv-pages nor --kv-cache-memory is given. `needed`: what
    every running request at full length would take."""
    if backend == "cpu":
        return min(needed, CPU_KV_CACHE_MEMORY)
    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return int(free * ACCELERATOR_KV_CACHE_FRACTION) if free > 0 else needed


def parse_memory_size(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '300000000' -> bytes."""
    units = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
             "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}  # fmt: skip
    number = text.strip().lower().rstrip("bitkmg")
    unit = text.strip().lower()[len(number) :]
    try:
        value = float(number) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(
            f"not a memory size: {text!r} (use e.g. 2GiB, 512MiB or a number of bytes)"
        ) from None
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value)


def resolve_quantize(quantize: str, backend: str, kind: str = "hf") -> str:
    """`auto` on CPU: int4 for a GGUF file where the native int4 kernel runs (build_runtime may take a
    file that mixes 4-bit with wider blocks to int8 after all: auto_quantize_mixed_gguf), else int8;
    elsewhere the float weights stay.

    int4 from GGUF repacks the file's 4- and 5-bit blocks as they are (its others go to int8), so it is
    closer to the file than int8, which requantises those blocks, holds 20% of the float32 bytes
    instead of 25%, and is no slower (SmolLM2 medians: one stream 167 vs 148 tok/s, 16 streams 935 vs
    858 on an AMD EPYC; docs/benchmarks.md). From a float checkpoint int4 would round
    every weight to 16 levels: auto keeps int8 there (2-3x faster than float32 at one row, 91-96%
    greedy agreement with the float model, perplexity within 1.1%)."""
    if quantize != "auto":
        return quantize
    if backend != "cpu":
        return "none"
    return "int4" if kind == "gguf" and int4_matmul_available() else "int8"


def auto_quantize_mixed_gguf() -> str:
    """What `auto` makes of a GGUF file that mixes 4-bit with wider blocks (Gemma 3's Q4_K_M: Q4_K, Q5_0,
    Q6_K, Q8_0) where the native int4 kernel runs: int4 (its 4- and 5-bit blocks kept as they are, the
    others int8) where the kernels run AVX2 alone, int8 with AVX-512 VNNI.

    With VNNI, one instruction multiplies and adds 4 int8 pairs, and the 4- and 5-bit kernels do more per
    weight than the int8 one: kept as int4 / int5 / int8, Gemma 3 on a Zen 4 EPYC (both runtimes in one
    process, alternated) decodes one stream 3% faster, 16 streams 10% slower and prefills 512 tokens 19%
    slower than as int8. AVX2's int8 product needs two vector multiplies per 32 multiply-adds
    (vpmaddubsw, then vpmaddwd to widen), the 4-bit one about one (its small products widen once per
    block of 32 inputs). On a Zen 1 EPYC, Gemma 3 kept as int4 against
    int8, two alternations: prefill 512 273-285 vs 224-230 tok/s (1.71-1.79x llama.cpp vs 1.40x), 16
    streams 88.5-89.1 vs 87.5-88.7, one stream 61.7-62.2 vs 65.0-65.5 (64.0 once the int5 tile spread its
    fifth bits with one shuffle: at one row nothing shares those vector ops); 8% fewer weight bytes
    (docs/benchmarks.md). With AVX-VNNI (vpdpbusd on 256 bits) int8 wins again: on an Intel Xeon capped
    at that code, prefill 512 1351 vs 1089 tok/s, 16 streams 369 vs 335, one stream 68.0 vs 72.9."""
    from jaxinfer.cpu_kernels.native_build import AVX2, best_isa

    return "int4" if best_isa() is AVX2 else "int8"


# The form of the converted weights in a cache entry's key: an entry written under another form (code
# that converted the same mode differently) is converted again rather than served.
CONVERTED_FORMAT = 2


def _weights_cache_entry(options: RuntimeOptions, gguf_path: Path, quantize: str, dtype: str) -> Path | None:
    """The converted-weights folder for this GGUF file and quantisation (keyed by the file's size and
    modification time), or None when there is nothing to cache (or several processes share the job)."""
    if not options.weights_cache_dir or quantize == "none":
        return None
    if jax.process_count() > 1:  # orbax saves and restores collectively across processes: keep it simple
        return None
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{quantize}-{dtype}-v{CONVERTED_FORMAT}"
    return Path(options.weights_cache_dir).expanduser() / key


def _save_converted(entry: Path, loaded: LoadedModel, tokenizer: Tokenizer) -> None:
    """Writes the quantised weights and the tokenizer to a temporary folder, then renames it into place,
    so a concurrent start sees either nothing or a complete entry. Failing to write only costs speed."""
    from jaxinfer.loading import save_checkpoint

    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        save_checkpoint(tmp, loaded.config, loaded.params, extra={"source": str(loaded.path)}, overwrite=True)
        tokenizer.save(str(tmp / "tokenizer"))
        os.replace(tmp, entry)
        log.info("saved converted weights to %s", entry)
    except OSError as e:
        log.warning("could not save converted weights to %s: %s", entry, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_converted(entry: Path, dtype: str, placement) -> tuple[LoadedModel, Tokenizer] | None:
    """A saved entry's weights and tokenizer; None (and the entry removed) when it is missing or damaged."""
    if not (entry / MODEL_FILE).is_file():
        return None
    try:
        loaded = load_model(entry, dtype=dtype, placement=placement)
        tokenizer = load_tokenizer(loaded)  # an orbax folder: its tokenizer/ subfolder
    except (ModelLoadError, OSError, ValueError) as e:
        log.warning("ignoring the damaged converted weights in %s: %s", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    log.info("loaded converted weights from %s", entry)
    return loaded, tokenizer


def default_heads_dir(model: str) -> Path:
    """Where the draft heads of `model` (a registry name or a path) live unless --draft-heads says."""
    return DEFAULT_DRAFT_HEADS / re.sub(r"[^A-Za-z0-9._-]+", "_", model).strip("_")


def _draft_heads(
    options: RuntimeOptions, config: ModelConfig
) -> tuple[DraftHeads | None, HeldOutDrafts | None]:
    """The draft heads of --draft-heads, else of the model's default folder when it exists (required
    when the server speculates with heads), and their held-out drafts where training kept them."""
    path = Path(options.draft_heads or default_heads_dir(str(options.model)))
    if not (path / HEADS_FILE).is_file():
        if options.speculation.method is SpeculativeMethod.HEADS:
            raise ValueError(
                f"--speculative heads needs draft heads: none in {path} (train them with "
                "scripts/train_draft_heads.py, or pass --draft-heads)"
            )
        return None, None
    heads, _ = load_heads(path, config)
    log.info("draft heads from %s: %d deep, %d-token vocabulary", path, heads.depth, heads.vocab.shape[0])
    return heads, HeldOutDrafts.load(path)


def _engine_thresholds(spec: SpeculationConfig | None) -> tuple[float, ...] | None:
    """The engine's draft_min_probability: None (chosen at warm-up) for AUTO."""
    if spec is None:
        return (0.0,)
    return None if spec.draft_min_probability == AUTO else spec.draft_min_probability


def enable_compilation_cache(directory: str | None) -> None:
    """JAX's persistent compilation cache: the second start of the same programs skips XLA compilation."""
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def program_cache_dir(options: RuntimeOptions, mesh: jax.sharding.Mesh) -> Path | None:
    """Where the engine keeps its compiled programs (program_cache), beside JAX's own cache entries;
    None where it keeps none: not asked to, no cache folder, or more than one device or process."""
    if not (options.program_cache and options.compilation_cache_dir):
        return None
    if not program_cache.serves(mesh):
        return None
    return Path(options.compilation_cache_dir) / "programs"


def load_tokenizer(loaded: LoadedModel, gguf_reader=None) -> Tokenizer:
    if loaded.kind == "gguf":
        return Tokenizer.from_gguf(loaded.path, reader=gguf_reader)
    if loaded.kind == "orbax":
        return Tokenizer.from_hf(loaded.path / "tokenizer")
    return Tokenizer.from_hf(loaded.path)


def _cache_config(options: RuntimeOptions, config: ModelConfig, dtype: str) -> CacheConfig:
    context = config.max_position_embeddings
    max_len = options.max_len or context
    if max_len > context:
        raise ValueError(f"max_len {max_len} exceeds the model's context length {context}")
    backend = jax.default_backend()
    page_size = default_page_size(options.page_size, backend)
    cache_dtype = default_cache_dtype(options.cache_dtype, dtype)
    num_pages = options.kv_pages and options.kv_pages + 1  # plus the null page
    if num_pages is None:
        per_page = bytes_per_page(config, page_size, cache_dtype)
        needed = options.num_slots * -(-max_len // page_size) * per_page
        memory = options.kv_cache_memory or default_kv_cache_memory(backend, needed)
        if memory < per_page:
            raise ValueError(f"{memory} bytes of KV cache hold no page of {per_page} bytes")
        num_pages = memory // per_page + 1  # plus the null page
    log.info("KV cache: %d pages of %d positions (%s)", num_pages - 1, page_size, cache_dtype)
    return CacheConfig(
        num_pages=num_pages, page_size=page_size, max_len=max_len, num_slots=options.num_slots,
        dtype=cache_dtype,
    )  # fmt: skip


def add_kernel_forms(params, kernels: KernelConfig):
    """The quantised weights in the forms the chosen kernels read: on CPU with native kernels, int8
    weights take their VNNI packing and int4 / int5 weights the int4 kernel's layouts; elsewhere int5
    weights become int8, and with XLA matmuls int8 weights gain bf16 copies for several rows
    (quantization.py)."""
    if kernels.matmul == "native":
        params = pack_int4_weights(params)
        return params if kernels.int8_activations else add_vnni_weights(params)
    params = int5_as_int8(params)
    if kernels.matmul == "xla" and not kernels.int8_activations:
        return add_bf16_copies(params)
    return params


def build_runtime(options: RuntimeOptions) -> Runtime:
    """Loads weights straight into their shardings and builds the engine (programs compile lazily or in
    `engine.warmup()`)."""
    start = time.perf_counter()
    mesh = make_mesh(options.mesh)
    programs = program_cache_dir(options, mesh)
    if programs is None:  # programs to keep compile afresh (program_cache)
        enable_compilation_cache(options.compilation_cache_dir)
    dtype = default_dtype(options.dtype)
    placement = param_placement(mesh)
    kind, path = resolve_model(options.model)
    quantize = resolve_quantize(options.quantize, jax.default_backend(), kind)
    # `auto` keys its own entry: what it resolves to depends on the file's contents (below) and the CPU.
    cache_key = f"auto-{auto_quantize_mixed_gguf()}" if options.quantize == "auto" else quantize
    entry = _weights_cache_entry(options, Path(path), cache_key, dtype) if kind == "gguf" else None
    cached = _load_converted(entry, dtype, placement) if entry is not None else None
    reader = None
    if cached is not None:
        loaded, tokenizer = dataclasses.replace(cached[0], kind="gguf", path=Path(path)), cached[1]
    else:
        if kind == "gguf":
            # Parsing a large vocabulary's GGUF metadata is not free: parse it once for both.
            reader = open_gguf(path)
            if options.quantize == "auto" and quantize == "int4" and not linear_weights_are_4bit(reader):
                quantize = auto_quantize_mixed_gguf()
            loaded = load_gguf(reader, dtype=dtype, placement=placement, int4=quantize == "int4")
            tokenizer = load_tokenizer(loaded, reader)
        else:
            loaded = load_model(path, dtype=dtype, placement=placement)
            tokenizer = load_tokenizer(loaded)
        if quantize != "none":  # leaves already quantised (a GGUF file's 4-/5-bit blocks) are kept
            before = weight_bytes(loaded.params)
            # A GGUF file's tensors stored above 4 bits (Q5_0, Q6_K, Q8_0) keep most of that as int8.
            mode = "int8" if kind == "gguf" else quantize
            loaded = dataclasses.replace(loaded, params=quantize_params(loaded.params, mode))
            log.info("%s weights: %.1f MiB -> %.1f MiB", quantize, before / 2**20,
                     weight_bytes(loaded.params) / 2**20)  # fmt: skip
            if entry is not None:
                _save_converted(entry, loaded, tokenizer)
    defaults = sampling_defaults(str(options.model), kind, Path(path), reader)
    if mesh.shape[TENSOR] == 1:
        loaded = dataclasses.replace(loaded, params=fuse_projections(loaded.params))
    cache_config = _cache_config(options, loaded.config, dtype)
    kernels = KernelConfig.for_backend(
        jax.default_backend(), options.attention_impl, single_device=mesh.size == 1
    )
    kernels = dataclasses.replace(kernels, int8_activations=options.int8_activations)
    loaded = dataclasses.replace(loaded, params=add_kernel_forms(loaded.params, kernels))
    min_rows = native_attention_min_rows(loaded.params["layers"], kernels)
    kernels = dataclasses.replace(kernels, native_attention_min_rows=min_rows)
    spec = options.speculation
    heads, held_out = _draft_heads(options, loaded.config) if spec is not None else (None, None)
    engine = JaxEngine(
        loaded.params,
        loaded.config,
        cache_config,
        mesh=mesh,
        max_prefill_chunk=options.max_prefill_chunk,
        kernels=kernels,
        num_draft_tokens=spec.num_draft_tokens if spec is not None else 0,
        draft_heads=heads,
        draft_min_probability=_engine_thresholds(spec),
        held_out_drafts=held_out,
        program_cache_dir=programs,
    )
    seconds = time.perf_counter() - start
    log.info("loaded %s (%s) in %.1fs", options.model, loaded.config.arch, seconds)
    return Runtime(engine, tokenizer, loaded, options, seconds, defaults)
