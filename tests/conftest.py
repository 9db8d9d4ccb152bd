"""Shared fixtures: tiny random Hugging Face checkpoints written by transformers, and the real models."""

from __future__ import annotations

import os

# Tests run on the CPU; a simulated 8-device host lets sharding tests build meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's time is XLA compiling thousands of small programs, and much of that is LLVM
# optimising their machine code: the suite compiles with LLVM's optimisation off. XLA's fusion emitters
# are the production ones (XLA's older emitters compile faster still, but a row's values then depend on
# how many rows a step runs), and matrix products and the native kernels are precompiled code either way.
# The README command's test runs the real model in a process with XLA's production settings.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
# One compilation cache for the whole run, shared with the subprocesses tests start: many tests compile
# the same tiny models' programs, and XLA compilation is most of the suite's time on a slow CPU.
_OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    _OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_COMPILATION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    if _OWN_COMPILATION_CACHE is not None and not hasattr(session.config, "workerinput"):
        import shutil

        shutil.rmtree(_OWN_COMPILATION_CACHE, ignore_errors=True)


TINY_DIMS = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    max_position_embeddings=256,
)


def _write_tiny(kind: str, directory) -> object:
    import torch
    import transformers

    torch.manual_seed(0)
    if kind == "gemma3":
        config = transformers.Gemma3TextConfig(
            **TINY_DIMS,
            num_hidden_layers=7,  # sliding x5, global, sliding: both layer types and their own RoPE bases
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=6,
            query_pre_attn_scalar=24,
        )
        model = transformers.Gemma3ForCausalLM(config)
    else:
        rope = None
        if kind == "llama3_scaled":
            rope = dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        config = transformers.LlamaConfig(
            **TINY_DIMS,
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            **({"rope_parameters": rope} if rope else {}),
        )
        model = transformers.LlamaForCausalLM(config)
    # Random init leaves norms at exactly 1 (or 0 for Gemma): perturb them so the norm convention is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """kind -> (checkpoint folder, torch reference model), written once per session on first use."""
    made: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in made:
            directory = tmp_path_factory.mktemp(f"tiny-{kind}")
            made[kind] = (directory, _write_tiny(kind, directory))
        return made[kind]

    return get


@pytest.fixture(scope="session")
def real_gguf():
    """name -> (path, reader, hf_config, hf_model): an embedded GGUF file parsed once, and the float32
    model transformers builds from it (the numerics oracle), shared by every test of the session."""
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            import gguf
            import torch
            import transformers

            from jaxinfer.loading.gguf_loader import open_gguf
            from jaxinfer.registry import resolve_model

            path = resolve_model(name)[1]
            reader = open_gguf(path)
            # transformers builds its own GGUFReader inside its loader; hand it the parsed one.
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(gguf, "GGUFReader", lambda *args, **kwargs: reader)
                hf_config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
                hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                    path.parent, gguf_file=path.name, config=hf_config, dtype=torch.float32
                ).eval()
            made[name] = (path, reader, hf_config, hf_model)
        return made[name]

    return get


@pytest.fixture(scope="session")
def real_runtime():
    """name -> jaxinfer Runtime on an embedded GGUF model (loaded once per session)."""
    from jaxinfer.runtime import RuntimeOptions, build_runtime

    made = {}

    def get(name: str):
        if name not in made:
            made[name] = build_runtime(
                # A float32 cache: compared token for token with the float32 transformers model (the CPU
                # default bfloat16 cache is checked in test_engine.py and test_quantization.py).
                RuntimeOptions(
                    model=name, num_slots=2, max_len=1024, cache_dtype="float32", compilation_cache_dir=None
                )
            )
        return made[name]

    return get


def _tiny_llama_with_real_vocab(directory, **dims):
    """A tiny random Llama over SmolLM2's real vocabulary, with its tokenizer saved beside it."""
    import torch
    import transformers

    from jaxinfer.registry import resolve_model
    from jaxinfer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct")[1])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.vocab_size, num_hidden_layers=2, num_key_value_heads=1, max_position_embeddings=512,
        **dims,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tok.save(directory)
    return directory


@pytest.fixture(scope="session")
def vocab_tokenizer():
    """SmolLM2's real tokenizer, saved beside tiny random checkpoints of every family."""
    from jaxinfer.registry import resolve_model
    from jaxinfer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct")[1])


@pytest.fixture(scope="session")
def tiny_with_tokenizer(tmp_path_factory):
    """A tiny random Llama over SmolLM2's real vocabulary, with its tokenizer saved beside it."""
    return _tiny_llama_with_real_vocab(
        tmp_path_factory.mktemp("tiny-real-vocab"),
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
    )


@pytest.fixture(scope="session")
def tiny_head_dim_64(tmp_path_factory):
    """The same with head_dim 64, which every attention kernel takes (the Pallas ones need 64, 128 or 256)."""
    return _tiny_llama_with_real_vocab(
        tmp_path_factory.mktemp("tiny-head-dim-64"),
        hidden_size=128,
        intermediate_size=96,
        num_attention_heads=2,
    )
