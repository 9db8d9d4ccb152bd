"""Weight loading against transformers as the reference.

* The two real GGUF files: our params equal the state dict transformers dequantises from the same file
  (after our conventions: Gemma norms +1), and config_from_gguf agrees with transformers' config.
* Tiny random Llama / Gemma 3 checkpoints written by transformers' save_pretrained (single file, sharded,
  bfloat16): our params equal the torch state dict.
* config.json in both generations of the format; orbax round trips; corrupt and missing files.

Each real file is parsed once per session (conftest.real_gguf) and the same reader serves us and
transformers.
"""

import gc
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading import (
    ModelLoadError,
    config_from_dict,
    config_from_gguf,
    config_from_hf,
    config_to_dict,
    load_checkpoint,
    load_gguf,
    load_model,
    load_safetensors,
    read_extra,
    save_checkpoint,
)
from jaxinfer.models.params import check_params, random_params
from jaxinfer.registry import ModelNotFoundError

# Hugging Face parameter names -> our leaf names (jaxinfer/models/params.py), written out independently of the
# loaders. Gemma's post_attention_layernorm is the sandwich norm; Llama's is the pre-MLP norm.
_HF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj",
    "self_attn.q_norm": "q_norm",
    "self_attn.k_norm": "k_norm",
    "pre_feedforward_layernorm": "mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
    "mlp.gate_proj": "gate_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}


def _our_leaf(params, hf_name: str, arch: str):
    """Our array for one Hugging Face parameter name."""
    if hf_name == "model.embed_tokens.weight":
        return params["embed"]
    if hf_name == "model.norm.weight":
        return params["final_norm"]
    if hf_name == "lm_head.weight":
        return params["lm_head"]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf_name)
    assert match, hf_name
    layer, sub = int(match.group(1)), match.group(2)
    if sub == "post_attention_layernorm":
        name = "post_attn_norm" if arch == "gemma3" else "mlp_norm"
    else:
        name = _HF_LAYER[sub]
    return params["layers"][layer][name]


def _assert_params_match_state_dict(config: ModelConfig, params, state_dict, *, atol: float) -> None:
    """Every torch tensor equals our leaf (Gemma norms: ours = 1 + theirs); every leaf is covered."""
    check_params(config, params)
    covered = set()
    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # transformers shares the embedding tensor
        ours = _our_leaf(params, hf_name, config.arch)
        covered.add(id(ours))
        expected = tensor.detach().to(torch.float32).numpy()
        if config.arch == "gemma3" and hf_name.endswith("norm.weight"):
            expected = expected + np.float32(1.0)
        assert ours.shape == expected.shape, hf_name
        ours = np.asarray(ours, np.float32)
        if np.array_equal(ours, expected):
            continue
        # max |difference| rather than assert_allclose, which takes ~12 s on Gemma's 168M-entry embedding
        max_diff = float(np.max(np.abs(ours - expected)))
        assert max_diff <= atol, f"{hf_name}: max |ours - transformers| = {max_diff}"
    assert covered == {id(leaf) for leaf in jax.tree.leaves(params)}


@pytest.fixture(scope="module")
def smollm(real_gguf):
    path, reader, hf_config, hf_model = real_gguf("smollm2-135m-instruct")
    ours = load_gguf(reader)
    yield path, reader, ours, hf_config, hf_model
    del ours
    gc.collect()


@pytest.fixture(scope="module")
def gemma(real_gguf):
    path, reader, hf_config, hf_model = real_gguf("gemma3-270m")
    ours = load_gguf(reader)
    yield path, reader, ours, hf_config, hf_model
    del ours
    gc.collect()


def _assert_config_matches_transformers(config: ModelConfig, hf) -> None:
    assert config.vocab_size == hf.vocab_size
    assert config.hidden_size == hf.hidden_size
    assert config.intermediate_size == hf.intermediate_size
    assert config.num_layers == hf.num_hidden_layers
    assert config.num_heads == hf.num_attention_heads
    assert config.num_kv_heads == hf.num_key_value_heads
    assert config.head_dim == hf.head_dim
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.tie_word_embeddings == hf.tie_word_embeddings


# ---------------------------------------------------------------------------------------------------------
# The real GGUF files


def test_smollm_gguf_params_equal_transformers(smollm):
    _, _, ours, _, hf_model = smollm
    assert ours.kind == "gguf"
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(ours.params))
    _assert_params_match_state_dict(ours.config, ours.params, hf_model.state_dict(), atol=1e-6)


def test_smollm_gguf_config_matches_transformers(smollm):
    _, reader, ours, hf, _ = smollm
    config = ours.config
    _assert_config_matches_transformers(config, hf)
    assert config.arch == "llama" and hf.model_type == "llama"
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rope_scaling == RopeScaling()
    assert config.activation == "silu" and hf.hidden_act == "silu"
    assert config.layer_types == ("full_attention",) * hf.num_hidden_layers
    assert config.sliding_window is None and config.qk_norm == "none" and config.embed_scale == 1.0
    assert config_from_gguf(reader) == config


def test_gemma3_gguf_params_equal_transformers(gemma):
    _, _, ours, _, hf_model = gemma
    _assert_params_match_state_dict(ours.config, ours.params, hf_model.state_dict(), atol=1e-6)


def test_gemma3_gguf_config_matches_transformers(gemma):
    _, reader, ours, hf, _ = gemma
    config = ours.config
    _assert_config_matches_transformers(config, hf)
    assert config.arch == "gemma3" and hf.model_type == "gemma3_text"
    assert config.layer_types == tuple(hf.layer_types)
    assert config.sliding_window == hf.sliding_window
    assert config.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert config.activation == "gelu_tanh" and hf.hidden_activation == "gelu_pytorch_tanh"
    assert config.qk_norm == "head" and config.norms == "sandwich"
    assert config.embed_scale == pytest.approx(hf.hidden_size**0.5)
    assert config.attn_logit_softcap == hf.attn_logit_softcapping
    assert config.final_logit_softcap == hf.final_logit_softcapping
    assert config_from_gguf(reader) == config


def test_gguf_placement_is_called_per_leaf(smollm):
    """Load the real SmolLM2 file again, from its path, through a recording placement, in bfloat16."""
    path, _, ours, _, _ = smollm
    calls = []
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def placement(key_path, shape, dtype):
        calls.append((key_path, shape, dtype))
        return sharding

    loaded = load_gguf(path, dtype="bfloat16", placement=placement)
    config = ours.config
    assert len(calls) == len(jax.tree.leaves(loaded.params))
    assert (("embed",), (config.vocab_size, config.hidden_size), "bfloat16") in calls
    q_shape = (config.num_heads * config.head_dim, config.hidden_size)
    assert (("layers", 3, "q_proj"), q_shape, "bfloat16") in calls
    q = loaded.params["layers"][3]["q_proj"]
    assert q.dtype == jnp.bfloat16 and q.sharding == sharding
    np.testing.assert_array_equal(
        np.asarray(q), np.asarray(ours.params["layers"][3]["q_proj"]).astype(jnp.bfloat16)
    )


# ---------------------------------------------------------------------------------------------------------
# Tiny Hugging Face checkpoints written by transformers


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random values everywhere, norms included, so that the (1 + w) convention is visible."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


def _tiny_llama_config():
    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def _tiny_gemma3_config():
    return transformers.Gemma3TextConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        max_position_embeddings=512,
        final_logit_softcapping=30.0,
    )


def test_tiny_llama_sharded_safetensors_equal_torch(tmp_path):
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    _randomize(model, seed=1)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    loaded = load_model(str(tmp_path))
    assert loaded.kind == "hf" and loaded.path == tmp_path
    _assert_params_match_state_dict(loaded.config, loaded.params, model.state_dict(), atol=0)
    hf = model.config
    config = loaded.config
    _assert_config_matches_transformers(config, hf)
    assert config.arch == "llama" and config.activation == "silu"
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_tiny_gemma3_safetensors_equal_torch(tmp_path):
    model = transformers.Gemma3ForCausalLM(_tiny_gemma3_config())
    _randomize(model, seed=2)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()

    loaded = load_safetensors(tmp_path)
    _assert_params_match_state_dict(loaded.config, loaded.params, model.state_dict(), atol=0)
    hf = model.config
    config = loaded.config
    _assert_config_matches_transformers(config, hf)
    assert config.layer_types == tuple(hf.layer_types)
    assert "full_attention" in config.layer_types and "sliding_attention" in config.layer_types
    assert config.sliding_window == 8 and config.query_pre_attn_scalar == 24
    assert config.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"]
    assert config.rope_local_theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert config.final_logit_softcap == 30.0 and config.attn_logit_softcap is None
    assert config.embed_scale == pytest.approx(hf.hidden_size**0.5)

    # The params are copies, not views of the memory-mapped file: overwriting it in place changes nothing.
    weights = tmp_path / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(4096)
        f.write(b"\x00" * (weights.stat().st_size - 4096))
    _assert_params_match_state_dict(loaded.config, loaded.params, model.state_dict(), atol=0)


def test_tiny_gemma3_bfloat16_checkpoint(tmp_path):
    """A bfloat16 save (read without torch): float32 load equals the bf16 values; bfloat16 load too."""
    model = transformers.Gemma3ForCausalLM(_tiny_gemma3_config())
    _randomize(model, seed=3)
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    state_dict = model.state_dict()

    loaded = load_safetensors(tmp_path)
    _assert_params_match_state_dict(loaded.config, loaded.params, state_dict, atol=0)

    as_bf16 = load_safetensors(tmp_path, dtype="bfloat16")
    expected_q = state_dict["model.layers.2.self_attn.q_proj.weight"].to(torch.float32).numpy()
    got_q = as_bf16.params["layers"][2]["q_proj"]
    assert got_q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_q, np.float32), expected_q)


# ---------------------------------------------------------------------------------------------------------
# config.json formats


def _legacy_gemma3_dict(**overrides):
    return {
        "model_type": "gemma3_text",
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 13,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 64,
        "sliding_window_pattern": 6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        **overrides,
    }


def test_hf_config_legacy_and_transformers5_gemma3_agree():
    legacy = _legacy_gemma3_dict()
    # transformers itself converts the legacy keys into per-layer-type rope_parameters and layer_types.
    modern = transformers.Gemma3TextConfig(**legacy).to_dict()
    assert set(modern["rope_parameters"]) == {"full_attention", "sliding_attention"}
    assert "rope_local_base_freq" not in modern and "layer_types" in modern
    from_legacy, from_modern = config_from_hf(legacy), config_from_hf(modern)
    assert from_legacy == from_modern
    assert from_legacy.rope_scaling == RopeScaling("linear", factor=8.0)
    assert from_legacy.rope_theta == 1e6 and from_legacy.rope_local_theta == 1e4
    assert from_legacy.layer_types == tuple(modern["layer_types"])
    assert [i for i, t in enumerate(from_legacy.layer_types) if t == "full_attention"] == [5, 11]
    # The multimodal wrapper nests the text config.
    assert config_from_hf({"model_type": "gemma3", "text_config": legacy}) == from_legacy


@pytest.mark.parametrize(
    "rope_scaling, expected",
    [
        (None, RopeScaling()),
        ({"type": "linear", "factor": 4.0}, RopeScaling("linear", factor=4.0)),
        (
            {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            RopeScaling("llama3", 32.0, 1.0, 4.0, 8192),
        ),
    ],
)
def test_hf_config_llama_rope_scaling(rope_scaling, expected):
    legacy = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": rope_scaling,
    }
    modern = transformers.LlamaConfig(**legacy).to_dict()
    assert "rope_parameters" in modern
    config = config_from_hf(legacy)
    assert config == config_from_hf(modern)
    assert config.rope_scaling == expected
    assert config.rope_theta == 500000.0
    assert config.head_dim == 8  # head_dim absent: hidden / heads
    assert config.max_position_embeddings == modern["max_position_embeddings"]
    assert config.rms_norm_eps == modern["rms_norm_eps"]


def test_hf_config_rejects_unsupported():
    with pytest.raises(ModelLoadError, match="rope scaling kind 'yarn' is not supported"):
        config_from_hf(_legacy_gemma3_dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        config_from_hf({"model_type": "gpt2"})
    with pytest.raises(ModelLoadError, match="attention_bias"):
        config_from_hf({"model_type": "llama", "attention_bias": True})


# ---------------------------------------------------------------------------------------------------------
# orbax checkpoints


def _tiny_gemma3_model_config() -> ModelConfig:
    return config_from_hf(_legacy_gemma3_dict(vocab_size=64, num_hidden_layers=6))


def test_config_dict_round_trip_is_json():
    config = _tiny_gemma3_model_config()
    d = json.loads(json.dumps(config_to_dict(config)))
    assert d["rope_scaling"] == {
        "kind": "linear",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config_from_dict(d) == config
    with pytest.raises(ValueError, match="unknown fields"):
        config_from_dict(d | {"future_field": 1})


def test_orbax_round_trip_is_exact(tmp_path):
    config = _tiny_gemma3_model_config()
    params = random_params(config, seed=4)
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, config, params, extra={"source": "test", "step": 7})
    assert (directory / "jaxinfer_model.json").is_file()

    loaded = load_model(str(directory))  # the registry recognises the folder by jaxinfer_model.json
    assert loaded.kind == "orbax" and loaded.config == config
    assert read_extra(directory) == {"source": "test", "step": 7}
    assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
    for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save_checkpoint(directory, config, params)
    save_checkpoint(directory, config, random_params(config, seed=5), overwrite=True)
    again = load_checkpoint(directory)
    np.testing.assert_array_equal(
        np.asarray(again.params["embed"]), np.asarray(random_params(config, 5)["embed"])
    )


def test_orbax_restores_into_requested_shardings(tmp_path):
    config = _tiny_gemma3_model_config()
    params = random_params(config, seed=6)
    save_checkpoint(tmp_path / "ckpt", config, params)

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("model",))
    # Rows of 2-D leaves split over the devices (the row counts here divide any small device count).
    row_split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", None))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    requested = {}

    def placement(key_path, shape, dtype):
        assert dtype == "bfloat16"
        sharding = row_split if len(shape) == 2 and shape[0] % len(devices) == 0 else replicated
        requested[key_path] = sharding
        return sharding

    loaded = load_checkpoint(tmp_path / "ckpt", dtype="bfloat16", placement=placement)
    assert loaded.params["layers"][2]["q_proj"].sharding == row_split
    assert loaded.params["final_norm"].sharding == replicated
    assert requested[("layers", 2, "q_proj")] == row_split and len(requested) == len(jax.tree.leaves(params))
    for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params), strict=True):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))


def _metadata_gguf(path) -> None:
    """A small GGUF file with every kind of metadata array a vocabulary uses, and some it does not."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("test.tokens", ["<s>", "", "héllo", " ▁world", "\n"] * 7)
    writer.add_array("test.scores", [0.5, -1.25, 3.0] * 5)
    writer.add_array("test.types", [1, 2, 3, -4])
    writer.add_key_value("test.flags", [True, False, True], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    writer.add_key_value("test.bytes", [7, 255], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT8)
    writer.add_array("test.empty", [])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_string("test.name", "tiny")
    writer.add_uint32("test.count", 3)
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_fast_gguf_reader_reads_every_field_as_the_gguf_package_does(tmp_path):
    import gguf

    from jaxinfer.loading.gguf_loader import FastGGUFReader

    path = tmp_path / "meta.gguf"
    _metadata_gguf(path)
    fast, base = FastGGUFReader(path), gguf.GGUFReader(path)
    assert list(fast.fields) == list(base.fields)
    for name, want in base.fields.items():
        got = fast.fields[name]
        assert (got.offset, got.types, got.data) == (want.offset, want.types, want.data), name
        assert len(got.parts) == len(want.parts), name
        for a, b in zip(got.parts, want.parts):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert fast.data_offset == base.data_offset
    assert np.array_equal(fast.tensors[0].data, base.tensors[0].data)
    tokens = fast.fields["test.tokens"]
    assert [bytes(tokens.parts[i]).decode() for i in tokens.data][:5] == ["<s>", "", "héllo", " ▁world", "\n"]


# ---------------------------------------------------------------------------------------------------------
# Broken inputs


def test_garbage_and_empty_gguf_raise_model_load_error(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelLoadError, match="garbage.gguf is not a readable GGUF file"):
        load_gguf(garbage)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(garbage))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty.gguf is not a readable GGUF file"):
        config_from_gguf(empty)


def test_gguf_cut_inside_its_metadata_arrays_raises_model_load_error(tmp_path):
    whole = tmp_path / "meta.gguf"
    _metadata_gguf(whole)
    data = whole.read_bytes()
    # Inside the token strings' array, and inside the scores' array.
    for cut in (data.index("héllo".encode()) + 2, data.index(np.float32(3.0).tobytes()) + 2):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf is not a readable GGUF file"):
            config_from_gguf(short)


def test_truncated_real_gguf_raises_model_load_error(tmp_path, smollm):
    path = smollm[0]
    truncated = tmp_path / "truncated.gguf"
    with path.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(int(path.stat().st_size * 0.6)))  # cut inside the tensor data
    with pytest.raises(ModelLoadError, match="truncated.gguf is not a readable GGUF file"):
        load_gguf(truncated)


def test_missing_files_and_unknown_names(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_gguf(tmp_path / "absent.gguf")
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_safetensors(tmp_path)
    with pytest.raises(ModelLoadError, match="jaxinfer_model.json does not exist"):
        load_checkpoint(tmp_path)


def test_corrupt_safetensors_raise_model_load_error(tmp_path):
    model = transformers.LlamaForCausalLM(_tiny_llama_config())
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="do not fit its shape or the file"):
        load_safetensors(tmp_path)
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="exceeds the file size"):
        load_safetensors(tmp_path)
