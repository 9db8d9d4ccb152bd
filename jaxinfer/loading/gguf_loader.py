"""GGUF files (llama.cpp's format): the config from the metadata, the weights dequantised tensor by tensor.

The architecture names the model family (models/families.py); its metadata is read under the Hugging
Face config keys, so the family's one config builder serves both formats. Every type the `gguf`
package can dequantise is accepted (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, K-quants).

With `int4=True`, linear weights stored as Q4_0, Q4_1 or Q4_K blocks are repacked into
weight_formats.Int4Weight without a float round trip (`int4_blocks`): every 32-weight (sub-)block maps
onto one group's scale and minimum, so the model computes the file's own values. Stacked expert weights
(`ffn_gate_exps.weight` etc., [experts, out, in]) in those types become a stacked Int4Weight the same
way, their rows repacked as one [experts * out, in] matrix. Linear weights stored as Q5_0 or Q5_1 become
weight_formats.Int5Weight the same way (`int5_blocks`; stacked experts in those types load as float,
the grouped-matmul kernels read no 5-bit form). Tensors in other types load as float as usual
(quantization.quantize_params then takes them to int8).

Conventions of llama.cpp's files against ours (jaxinfer/models/params.py):
  * "llama"-architecture Q/K rows are stored permuted for adjacent-pair RoPE (Family.gguf_permutes_qk);
    we un-permute them to the half-split layout (Q with num_heads, K with num_kv_heads).
  * Gemma norm weights are stored with the +1 already folded in, which is our convention too.
  * Fused tensors (Phi-3's attn_qkv and ffn_up) split into their leaves; expert tensors come stacked
    [experts, out, in] already.
Facts a family's files leave out (Gemma 3's layer pattern and local RoPE base, Gemma's query scale,
Qwen3-MoE's routing normalisation) come from its Hugging Face defaults and `Family.gguf_facts`.

Reading the header of a file with a large vocabulary takes time (every token string is a part of its
field), so both entry points accept an open `gguf.GGUFReader` to share.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.loading.common import (
    KeyPath,
    LoadedModel,
    ModelLoadError,
    ParamsBuilder,
    Placement,
    aligned_empty,
)
from jaxinfer.models.families import family_for_gguf, family_named
from jaxinfer.models.family import Family
from jaxinfer.quantization import INT4_LEAVES, LINEAR_LEAVES
from jaxinfer.weight_formats import Int4Weight, Int5Weight

_TOP_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm", "output.weight": "lm_head"}
# GGUF metadata keys (after "{arch}.") -> the Hugging Face config keys every family reads.
_HF_KEYS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "context_length": "max_position_embeddings",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
    "expert_used_count": "num_experts_per_tok",
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

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray], list[int], list[gguf.GGUFValueType]]:
        """The base reader's parts for a metadata value, with arrays of scalars and of strings (a
        vocabulary's tokens, scores and types) cut in one pass instead of one recursive call per element.
        Other values, and files of the other byte order, take the base reader's path."""
        if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        length = self._get(orig_offs + 4, np.uint64)
        count, offs = int(length[0]), orig_offs + 12
        item_type = gguf.GGUFValueType(raw_itype[0])
        types = [gguf.GGUFValueType.ARRAY] + ([item_type] if count else [])
        parts: list[np.ndarray] = [raw_itype, length]
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            values = self._get(offs, scalar, count)
            if values.size != count:
                raise ValueError(f"array of {count} values cut short at byte {offs}")
            parts += list(values.reshape(count, 1))  # one single-element view per item, as the base reader
            return 12 + values.nbytes, parts, list(range(2, 2 + count)), types
        if item_type != gguf.GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        data, u64 = self.data, np.dtype(np.uint64)
        for _ in range(count):
            size = data[offs : offs + 8].view(u64)
            end = offs + 8 + int(size[0])
            if end > data.size:
                raise ValueError(f"string at byte {offs} runs past the end of the file")
            parts += (size, data[offs + 8 : end])
            offs = end
        return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), types

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
    stat = path.stat()
    try:
        return _parsed_reader(path, stat.st_size, stat.st_mtime_ns)
    except Exception as e:  # the reader fails in many ways on bad bytes (struct, numpy, enum, unicode)
        raise ModelLoadError(f"{path} is not a readable GGUF file: {_first_line(e)}") from e


@functools.lru_cache(maxsize=4)
def _parsed_reader(path: Path, size: int, mtime_ns: int) -> FastGGUFReader:
    """Parsing a large vocabulary's metadata takes most of a second (Gemma 3's 262k tokens), and
    the reader is read-only: an unchanged file (same size and modification time) is parsed once per
    process, however many loaders, tokenizers and runtimes open it."""
    return FastGGUFReader(path)


def _reader_path(reader: gguf.GGUFReader) -> Path:
    return reader.path if isinstance(reader, FastGGUFReader) else Path(reader.data.filename)


def config_from_gguf(path_or_reader: str | Path | gguf.GGUFReader) -> ModelConfig:
    """The ModelConfig a GGUF file's metadata (and tensor list) describes."""
    reader = open_gguf(path_or_reader)
    family = gguf_family(reader)
    return family.build_config(_hf_config_dict(reader, family))


def gguf_family(reader: gguf.GGUFReader) -> Family:
    """The model family of a GGUF file (models/families.py), from its architecture and expert count."""
    arch = _field(reader, "general.architecture")
    return family_for_gguf(arch, int(_field(reader, f"{arch}.expert_count", 0) or 0))


def _hf_config_dict(reader: gguf.GGUFReader, family: Family) -> dict[str, Any]:
    """The file's metadata under the Hugging Face config keys the family's builder reads."""
    arch = _field(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError("GGUF rope_freqs.weight (Llama 3 RoPE scaling as a tensor) is not supported")
    cfg: dict[str, Any] = {"model_type": family.hf_model_types[0]}
    for key, hf_key in (_HF_KEYS | dict(family.gguf_metadata)).items():
        value = _field(reader, f"{arch}.{key}", None)
        if value is not None:
            cfg[hf_key] = value
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps"):
        if key not in cfg:
            raise ModelLoadError(f"GGUF metadata lacks the {arch} key for {key}")
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    head_dim = cfg["head_dim"]
    if int(_field(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF value_length differs from key_length {head_dim}; not supported")
    if int(_field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(f"GGUF partial RoPE (rope.dimension_count != {head_dim=}) is not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    elif scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling type {scaling!r} is not supported (supported: none, linear)")
    # GGML dims are innermost-first: token_embd is (hidden, vocab).
    cfg["vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    cfg["tie_word_embeddings"] = "output.weight" not in tensors
    cfg["_name_or_path"] = str(_field(reader, "general.name", "")) or arch
    if family.gguf_facts is not None:
        cfg |= family.gguf_facts(cfg)
    return cfg


def load_gguf(
    path: str | Path | gguf.GGUFReader,
    *,
    dtype: str = "float32",
    placement: Placement | None = None,
    int4: bool = False,
) -> LoadedModel:
    """Reads config and weights from a GGUF file, dequantising (or, with int4, repacking 4- and 5-bit
    blocks) and placing one tensor at a time."""
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    family = family_named(config.arch)
    builder = ParamsBuilder(config, dtype=dtype, placement=placement)
    for tensor in reader.tensors:
        key_path = _key_path(tensor.name, family)
        if key_path is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} has no place in the {config.arch} params")
        if isinstance(key_path[-1], tuple):  # a fused tensor (Phi-3's attn_qkv)
            parts = tuple((*key_path[:-1], leaf) for leaf in key_path[-1])
            builder.put_rows(parts, _host_tensor(tensor, key_path, family, config), source=tensor.name)
        elif int4 and _kept_as_blocks(key_path[-1], tensor.tensor_type):
            blocks = _host_blocks(tensor, key_path, family, config)
            builder.put_quantized(key_path, blocks, source=tensor.name)
        else:
            value = _host_tensor(tensor, key_path, family, config)
            builder.put(key_path, value, source=tensor.name, owned=True)
    return LoadedModel(config=config, params=builder.finish(), kind="gguf", path=_reader_path(reader))


Q = gguf.GGMLQuantizationType
INT4_BLOCK_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
INT5_BLOCK_TYPES = (Q.Q5_0, Q.Q5_1)


def _kept_as_blocks(leaf: str, tensor_type) -> bool:
    """Whether int4 mode keeps a tensor's blocks as they are: 4-bit ones of every linear weight (stacked
    experts included), 5-bit ones of the plain linear weights (the grouped matmuls read no 5-bit form)."""
    if tensor_type in INT4_BLOCK_TYPES:
        return leaf in INT4_LEAVES
    return tensor_type in INT5_BLOCK_TYPES and leaf in LINEAR_LEAVES


def linear_weights_are_4bit(reader: gguf.GGUFReader) -> bool:
    """Whether every linear weight of the layers, stacked expert weights included, is stored in a 4-bit
    block type (INT4_BLOCK_TYPES)."""
    family = gguf_family(reader)
    kinds = [t.tensor_type for t in reader.tensors if (_key_path(t.name, family) or ("",))[-1] in INT4_LEAVES]
    return bool(kinds) and all(kind in INT4_BLOCK_TYPES for kind in kinds)


def int4_blocks(data: np.ndarray, tensor_type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 4-bit GGUF tensor's raw rows uint8 [rows, row bytes] -> (q uint8 [rows, cols] in [0, 15],
    scale float32 [rows, cols / 32], minimum float32 [rows, cols / 32]) with w = q * scale + minimum
    exactly as llama.cpp dequantises it (float16 block scales widen exactly; Q4_K's d * sc and dmin * m
    are products of a float16 and a 6-bit integer, exact in float32)."""
    rows = data.shape[0]
    if tensor_type in (Q.Q4_0, Q.Q4_1):
        block = 18 if tensor_type == Q.Q4_0 else 20
        blocks = data.reshape(rows, -1, block)
        d = _f16(blocks[..., 0:2])
        minimum = -8.0 * d if tensor_type == Q.Q4_0 else _f16(blocks[..., 2:4])
        q = _nibbles(blocks[..., block - 16 :])
        return q.reshape(rows, -1), d, minimum
    if tensor_type == Q.Q4_K:
        blocks = data.reshape(rows, -1, 144)
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
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


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes of float16 -> float32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32]: the low nibbles first, then the high ones (GGUF's 32-weight blocks)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def int5_blocks(data: np.ndarray, tensor_type) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A 5-bit GGUF tensor's raw rows uint8 [rows, row bytes] -> (q uint8 [rows, cols] in [0, 31], scale
    float32 [rows, cols / 32], minimum float32 [rows, cols / 32]) with w = q * scale + minimum exactly as
    llama.cpp dequantises it: Q5_0 w = d * (q - 16), Q5_1 w = d * q + m; a block's 32-bit qh holds the
    fifth bits, bit j for the value in byte j's low nibble (input j), bit j + 16 for its high one (j + 16)."""
    if tensor_type not in INT5_BLOCK_TYPES:
        raise ValueError(f"{tensor_type.name} is not a 5-bit block type (Q5_0, Q5_1)")
    rows = data.shape[0]
    block = 22 if tensor_type == Q.Q5_0 else 24
    blocks = data.reshape(rows, -1, block)
    d = _f16(blocks[..., 0:2])
    minimum, at = (-16.0 * d, 2) if tensor_type == Q.Q5_0 else (_f16(blocks[..., 2:4]), 4)
    qh = np.ascontiguousarray(blocks[..., at : at + 4]).view("<u4")[..., 0]  # [rows, blocks]
    fifth = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    qs = blocks[..., at + 4 :]
    q = _nibbles(qs) | (fifth << 4)
    return q.reshape(rows, -1), d, minimum


def _host_blocks(
    tensor: Any, key_path: KeyPath, family: Family, config: ModelConfig
) -> Int4Weight | Int5Weight:
    """One 4- or 5-bit tensor as a host Int4Weight or Int5Weight in our layout ([out, in], half-split Q/K
    rows; stacked expert weights [experts, out, in] with scale and minimum [experts, out, groups])."""
    shape = tuple(reversed(tensor.shape.tolist()))  # numpy order: [..., out, in]
    data = tensor.data.reshape(-1, tensor.data.shape[-1])  # [rows, row bytes]
    five = tensor.tensor_type in INT5_BLOCK_TYPES
    blocks = int5_blocks if five else int4_blocks
    q, scale, minimum = (a.reshape(*shape[:-1], -1) for a in blocks(data, tensor.tensor_type))
    if family.gguf_permutes_qk and key_path[-1] in ("q_proj", "k_proj"):
        heads = config.num_heads if key_path[-1] == "q_proj" else config.num_kv_heads
        q, scale, minimum = (unpermute_rope_rows(a, heads) for a in (q, scale, minimum))
    return (Int5Weight if five else Int4Weight).from_values(q, scale, minimum, GGUF_BLOCK)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Adjacent-pair RoPE rows (GGUF) -> half-split rows (Hugging Face), per head.

    w: [num_heads * head_dim, in]. GGUF row 2j + p of a head holds half-split row p * head_dim/2 + j.
    """
    rows, cols = w.shape
    if rows % (2 * num_heads):
        raise ValueError(f"{w.shape=} rows must split into {num_heads=} heads of even size")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _host_tensor(tensor: Any, key_path: KeyPath, family: Family, config: ModelConfig) -> np.ndarray:
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
    if family.gguf_permutes_qk and key_path[-1] == "q_proj":
        value = unpermute_rope_rows(value, config.num_heads)
    elif family.gguf_permutes_qk and key_path[-1] == "k_proj":
        value = unpermute_rope_rows(value, config.num_kv_heads)
    return value


def _key_path(name: str, family: Family) -> tuple | None:
    """Where a GGUF tensor goes in our params; a fused tensor's key path ends in a tuple of leaves."""
    if name in _TOP_TENSORS:
        return (_TOP_TENSORS[name],)
    prefix, _, rest = name.partition(".")
    index, _, suffix = rest.partition(".")
    if prefix == "blk" and index.isdigit() and suffix in family.gguf_tensors:
        return ("layers", int(index), family.gguf_tensors[suffix])
    return None


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
