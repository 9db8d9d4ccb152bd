"""GGUF files (llama.cpp's format): the config from the metadata, the weights dequantised tensor by tensor.

Supported architectures: "llama" (SmolLM2, Llama, Mistral as llama.cpp writes them) and "gemma3".
Every type the `gguf` package can dequantise is accepted (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, K-quants).

With `int4=True`, linear weights stored as Q4_0, Q4_1 or Q4_K blocks are repacked into
weight_formats.Int4Weight without a float round trip (`int4_blocks`): every 32-weight (sub-)block maps
onto one group's scale and minimum, so the model computes the file's own values. Tensors in other types
load as float as usual (quantization.quantize_params then takes them to int8).

Two conversions turn llama.cpp's conventions into ours (jaxinfer/params.py):
  * Llama Q/K rows are stored permuted for adjacent-pair RoPE; we un-permute them to the half-split
    layout (Q with num_heads, K with num_kv_heads). Gemma 3 files are written unpermuted.
  * Gemma 3 norm weights are stored with the +1 already folded in, which is our convention too.

Gemma 3 facts the metadata leaves out and we fill in: every sixth layer is global (layer i is full
attention iff (i + 1) % 6 == 0) and the local layers' RoPE base is 10000.

Reading the header of a file with a large vocabulary is slow (GGUFReader parses every token string;
~10 s for Gemma 3's 262k tokens here), so both entry points accept an open `gguf.GGUFReader` to share.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.config import ModelConfig, RopeScaling
from jaxinfer.loading.common import (
    KeyPath,
    LoadedModel,
    ModelLoadError,
    ParamsBuilder,
    Placement,
    aligned_empty,
)
from jaxinfer.quantization import LINEAR_LEAVES
from jaxinfer.weight_formats import Int4Weight

SUPPORTED_ARCHS = ("llama", "gemma3")
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0

_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "attn_q.weight": "q_proj",
    "attn_k.weight": "k_proj",
    "attn_v.weight": "v_proj",
    "attn_output.weight": "o_proj",
    "attn_q_norm.weight": "q_norm",
    "attn_k_norm.weight": "k_norm",
    "post_attention_norm.weight": "post_attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "post_ffw_norm.weight": "post_mlp_norm",
    "ffn_gate.weight": "gate_proj",
    "ffn_up.weight": "up_proj",
    "ffn_down.weight": "down_proj",
}
_MISSING = object()
GGUF_BLOCK = 32  # weights per Q4_0 / Q4_1 block and per Q4_K sub-block
_DEQUANT_CHUNK_ELEMENTS = 1 << 22  # 16 MB of float32 per dequantise call


class FastGGUFReader(gguf.GGUFReader):
    """GGUFReader over a plain ndarray view of the mapped file: the same bytes, without numpy.memmap's
    bookkeeping on every slice, which is ~90% of the time numpy.memmap takes to parse a large vocabulary."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        super().__init__(path)

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # The view keeps the memory map alive as its base.
        self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value


def open_gguf(path_or_reader: str | Path | gguf.GGUFReader) -> gguf.GGUFReader:
    """A GGUFReader for a path (or the reader itself); unreadable files raise ModelLoadError."""
    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    if not isinstance(path_or_reader, (str, Path)):
        raise ValueError(f"{type(path_or_reader)=} must be a path or a gguf.GGUFReader")
    path = Path(path_or_reader).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    try:
        return FastGGUFReader(path)
    except Exception as e:  # the reader fails in many ways on bad bytes (struct, numpy, enum, unicode)
        raise ModelLoadError(f"{path} is not a readable GGUF file: {_first_line(e)}") from e


def _reader_path(reader: gguf.GGUFReader) -> Path:
    return reader.path if isinstance(reader, FastGGUFReader) else Path(reader.data.filename)


def config_from_gguf(path_or_reader: str | Path | gguf.GGUFReader) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and tensor list) describes."""
    reader = open_gguf(path_or_reader)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {SUPPORTED_ARCHS})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError("GGUF rope_freqs.weight (Llama 3 RoPE scaling as a tensor) is not supported")

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden // num_heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF value_length differs from key_length {head_dim}; not supported")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF partial RoPE (rope.dimension_count != {head_dim=}) is not supported")
    num_layers = int(meta("block_count"))
    # GGML dims are innermost-first: token_embd is (hidden, vocab).
    vocab_size = int(tensors["token_embd.weight"].shape[-1])
    common = dict(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(meta("context_length")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_scaling=_rope_scaling(meta),
        tie_word_embeddings="output.weight" not in tensors,
        name=str(_field(reader, "general.name", "")),
    )
    try:
        if arch == "llama":
            return ModelConfig(**common, rope_theta=float(meta("rope.freq_base", 10000.0)), activation="silu")
        softcap = meta("attn_logit_softcapping", None)
        final_softcap = meta("final_logit_softcapping", None)
        return ModelConfig(
            **common,
            rope_theta=float(meta("rope.freq_base", 1_000_000.0)),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
            sliding_window=int(meta("attention.sliding_window")),
            layer_types=tuple(
                "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
                for i in range(num_layers)
            ),
            activation="gelu_tanh",
            # Hugging Face's query_pre_attn_scalar equals head_dim for the Gemma 3 sizes GGUF carries.
            query_pre_attn_scalar=float(head_dim),
            qk_norm=True,
            sandwich_norms=True,
            embed_scale=math.sqrt(hidden),
            attn_logit_softcap=None if softcap is None else float(softcap),
            final_logit_softcap=None if final_softcap is None else float(final_softcap),
        )
    except ValueError as e:
        raise ModelLoadError(f"GGUF metadata gives an invalid config: {_first_line(e)}") from e


def load_gguf(
    path: str | Path | gguf.GGUFReader,
    *,
    dtype: str = "float32",
    placement: Placement | None = None,
    int4: bool = False,
) -> LoadedModel:
    """Reads config and weights from a GGUF file, dequantising (or, with int4, repacking 4-bit blocks)
    and placing one tensor at a time."""
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    builder = ParamsBuilder(config, dtype=dtype, placement=placement)
    for tensor in reader.tensors:
        key_path = _key_path(tensor.name)
        if key_path is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} has no place in the {config.arch} params")
        if int4 and key_path[-1] in LINEAR_LEAVES and tensor.tensor_type in INT4_BLOCK_TYPES:
            builder.put_quantized(key_path, _host_int4(tensor, key_path, config), source=tensor.name)
        else:
            builder.put(key_path, _host_tensor(tensor, key_path, config), source=tensor.name, owned=True)
    return LoadedModel(config=config, params=builder.finish(), kind="gguf", path=_reader_path(reader))


Q = gguf.GGMLQuantizationType
INT4_BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)


def linear_weights_are_4bit(reader: gguf.GGUFReader) -> bool:
    """Whether every linear weight of the layers is stored in a 4-bit block type (INT4_BLOCK_TYPES)."""
    kinds = [t.tensor_type for t in reader.tensors if (_key_path(t.name) or ("",))[-1] in LINEAR_LEAVES]
    return bool(kinds) and all(kind in INT4_BLOCK_TYPES for kind in kinds)


def int4_blocks(data: np.ndarray, tensor_type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit GGUF tensor's raw rows uint8 [rows, row bytes] -> (q uint8 [rows, cols] in [0, 15],
    scale float32 [rows, cols / 32], minimum float32 [rows, cols / 32]) with w = q * scale + minimum
    exactly as llama.cpp dequantises it (float16 block scales widen exactly; Q4_K's d * sc and dmin * m
    are products of a float16 and a 6-bit integer, exact in float32)."""
    rows = data.shape[0]

    def f16(raw: np.ndarray) -> np.ndarray:  # [..., 2] bytes -> float32 [...]
        return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [..., 16] -> [..., 32]: low nibbles first, then high
        return np.concatenate([qs & 15, qs >> 4], axis=-1)

    if tensor_type in (Q.Q4_0, Q.Q4_1):
        block = 18 if tensor_type == Q.Q4_0 else 20
        blocks = data.reshape(rows, -1, block)
        d = f16(blocks[..., 0:2])
        minimum = -8.0 * d if tensor_type == Q.Q4_0 else f16(blocks[..., 2:4])
        q = nibbles(blocks[..., block - 16 :])
        return q.reshape(rows, -1), d, minimum
    if tensor_type == Q.Q4_K:
        blocks = data.reshape(rows, -1, 144)
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])
        packed = blocks[..., 4:16].astype(np.uint8)  # 8 six-bit scales and minimums in 12 bytes
        low, high = packed[..., 0:4], packed[..., 4:8]
        sc = np.concatenate([low & 63, (packed[..., 8:12] & 15) | ((low >> 6) << 4)], axis=-1)
        m = np.concatenate([high & 63, (packed[..., 8:12] >> 4) | ((high >> 6) << 4)], axis=-1)
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # each 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        q = np.stack([qs & 15, qs >> 4], axis=-2)  # [rows, super-blocks, 4, 2, 32]
        scale = d[..., None] * sc.astype(np.float32)
        minimum = -(dmin[..., None] * m.astype(np.float32))
        return q.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1)
    raise ValueError(f"{tensor_type.name} is not a 4-bit block type ({[t.name for t in INT4_BLOCK_TYPES]})")


def _host_int4(tensor: Any, key_path: KeyPath, config: ModelConfig) -> Int4Weight:
    """One 4-bit tensor as a host Int4Weight in our layout ([out, in], half-split Q/K rows)."""
    data = tensor.data.reshape(-1, tensor.data.shape[-1])
    q, scale, minimum = int4_blocks(data, tensor.tensor_type)
    if config.arch == "llama" and key_path[-1] in ("q_proj", "k_proj"):
        heads = config.num_heads if key_path[-1] == "q_proj" else config.num_kv_heads
        q, scale, minimum = (unpermute_rope_rows(a, heads) for a in (q, scale, minimum))
    return Int4Weight.from_values(q, scale, minimum, GGUF_BLOCK)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Adjacent-pair RoPE rows (GGUF) -> half-split rows (Hugging Face), per head.

    w: [num_heads * head_dim, in]. GGUF row 2j + p of a head holds half-split row p * head_dim/2 + j.
    """
    rows, cols = w.shape
    if rows % (2 * num_heads):
        raise ValueError(f"{w.shape=} rows must split into {num_heads=} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _host_tensor(tensor: Any, key_path: KeyPath, config: ModelConfig) -> np.ndarray:
    """One tensor dequantised to a fresh float32 array in our layout ([out, in] for linears).

    Rows are dequantised in chunks into one preallocated array: dequantising a whole embedding at once
    needs about twice its float32 size in temporaries.
    """
    row_len = int(tensor.shape[0])  # GGML's innermost dimension
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])  # [rows, row bytes (or row_len for float types)]
    value = aligned_empty((rows.shape[0], row_len), np.float32)
    chunk = max(1, _DEQUANT_CHUNK_ELEMENTS // row_len)
    try:
        for start in range(0, rows.shape[0], chunk):
            value[start : start + chunk] = gguf.quants.dequantize(
                rows[start : start + chunk], tensor.tensor_type
            )
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(
            f"GGUF tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be dequantised: "
            f"{_first_line(e)}"
        ) from e
    value = value.reshape(tuple(reversed(tensor.shape.tolist())))
    if config.arch == "llama" and key_path[-1] == "q_proj":
        value = unpermute_rope_rows(value, config.num_heads)
    elif config.arch == "llama" and key_path[-1] == "k_proj":
        value = unpermute_rope_rows(value, config.num_kv_heads)
    return value


def _key_path(name: str) -> KeyPath | None:
    if name in _TOP_TENSORS:
        return (_TOP_TENSORS[name],)
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix == "blk" and index.isdigit() and suffix in _LAYER_TENSORS:
        return ("layers", int(index), _LAYER_TENSORS[suffix])
    return None


def _rope_scaling(meta) -> RopeScaling:
    kind = meta("rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(meta("rope.scaling.factor")))
    raise ModelLoadError(f"GGUF rope scaling type {kind!r} is not supported (supported: none, linear)")


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return default
    try:
        return field.contents()
    except Exception as e:
        raise ModelLoadError(f"GGUF metadata {key!r} is unreadable: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
