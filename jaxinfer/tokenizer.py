"""Tokenizers for the models jaxinfer serves, built from GGUF metadata or a Hugging Face tokenizer folder.

Two vocabularies occur, and each is rebuilt in the library its original was trained with:

* `tokenizer.ggml.model == "gpt2"` (SmolLM2, Llama 3, Qwen 2/2.5/3, OLMo 2, Phi-4): byte-level BPE from the
  GGUF tokens and merges, run by the `tokenizers` library behind the pre-tokenizer that `tokenizer.ggml.pre`
  names (`_BYTE_LEVEL_PRE_TOKENIZERS`: the regex splits of llama.cpp's src/llama-vocab.cpp, written as the
  models' own tokenizer.json files write them). SmolLM2's ("smollm") isolates every digit before the
  byte-level regex split. The vocabulary has no multi-digit tokens, so the digit split shows up through
  whitespace: without it "x   1" becomes "x", "ĠĠ", "Ġ", "1" instead of "x", "ĠĠĠ", "1". transformers' GGUF
  loader drops that split; this module keeps it.
* `tokenizer.ggml.model == "llama"` (Gemma 2/3, Llama 2, Mistral, Mixtral, Phi-3): a SentencePiece BPE model
  (scores, token types, byte fallback) rebuilt as a `ModelProto` and run by `sentencepiece`. The normalizer
  is llama.cpp's: spaces become "▁", nothing else changes, and a dummy "▁" is prepended to each text
  fragment when `tokenizer.ggml.add_space_prefix` is true (its default; Gemma's files set it false).
  llama.cpp's converter rewrote the "▁" of user-defined pieces (whitespace runs such as "▁▁") to plain
  spaces; they are turned back so SentencePiece matches them in its escaped text.

Control tokens (`<|im_start|>`, `<start_of_turn>`, `<bos>` ...) are matched in the text first, so chat markup
encodes to single ids. BOS is never added by the backends; `Tokenizer.encode` adds it from the metadata.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import gguf
import numpy as np
import sentencepiece
import tokenizers
from sentencepiece import sentencepiece_model_pb2
from tokenizers import decoders, normalizers, pre_tokenizers, processors

from jaxinfer.chat_template import ChatTemplate
from jaxinfer.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

# GGUF token types; the same numbering as SentencePiece's ModelProto.SentencePiece.Type.
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Tokens that end a turn or a document in the chat formats we know; each one that is a special token of the
# vocabulary joins the model's declared eos (generation must stop on them even where metadata omits them).
END_OF_TURN_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>")

# ---- byte-level BPE pre-tokenizers, by GGUF `tokenizer.ggml.pre`
#
# llama.cpp's converter names a vocabulary's pre-tokenizer by hashing how it encodes a probe text
# (convert_hf_to_gguf.py, get_vocab_base_pre); llama.cpp (src/llama-vocab.cpp) then splits the text with
# a list of regexes per name, each regex isolating its matches within the pieces of the one before, and
# byte-encodes the pieces. Here the same splits are `tokenizers` pre-tokenizers, in the form the models'
# tokenizer.json files use: Split(regex, behavior="isolated", invert=False) then
# ByteLevel(add_prefix_space=False, use_regex=False). The regexes are those of the tokenizer.json files
# (llama.cpp spells the case-insensitive contractions "(?i:'s|...)" out as "'[sS]|..." for its own regex
# engine; the two differ only on the few characters that case-fold to ASCII letters, such as "ſ").

# GPT-2's split (also ByteLevel's own regex, with a trailing "|\s+" that changes no split).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# Llama 3's (tiktoken's cl100k_base): digits in groups of up to three, a letter run takes one leading
# non-letter, newlines stay with the punctuation or whitespace before them.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Qwen 2's: Llama 3's with single digits.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral NeMo, Small 3, Ministral): letter runs split at case changes, single digits,
# "/" kept after punctuation.
_TEKKEN_REGEX = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's "default" (also what it uses when a BPE file has no tokenizer.ggml.pre, warning that
# generation quality will be degraded): punctuation runs, GPT-2's split, digit runs, then three-digit
# groups. Not GPT-2's split.
_DEFAULT_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclasses.dataclass(frozen=True)
class _ByteLevelPre:
    """How llama.cpp runs the byte-level BPE vocabularies of one `tokenizer.ggml.pre` name."""

    pre_tokenizer: Any  # a tokenizers pre-tokenizer
    # Whether a pre-token that is itself a vocabulary entry is taken whole, before merges (tiktoken's rule;
    # llama.cpp's ignore_merges, tokenizer.json's "ignore_merges").
    ignore_merges: bool = False
    add_bos: bool = False  # llama.cpp's default where tokenizer.ggml.add_bos_token is absent
    normalizer: Any | None = None  # a tokenizers normalizer the original tokenizer.json applies


def _regex_splits(*regexes: str) -> Any:
    splits = [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated", invert=False) for r in regexes]
    return pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
_GPT2_PRE = _ByteLevelPre(_BYTE_LEVEL)
# Llama 3 and 3.x ("llama-bpe"; "llama3" and "llama-v3" are llama.cpp's aliases): ignore_merges as in its
# tokenizer.json, and BOS by default.
_LLAMA3_PRE = _ByteLevelPre(_regex_splits(_LLAMA3_REGEX), ignore_merges=True, add_bos=True)
# The same split without ignore_merges: tiktoken cl100k_base vocabularies (DBRX, OLMo 2, Phi-4 hash as
# "dbrx") and Smaug-Llama-3.
_CL100K_PRE = _ByteLevelPre(_regex_splits(_LLAMA3_REGEX))
_BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _ByteLevelPre(_regex_splits(*_DEFAULT_REGEXES)),
    "gpt-2": _GPT2_PRE,
    "olmo": _GPT2_PRE,  # OLMo 1 (GPT-NeoX's vocabulary)
    "smollm": _ByteLevelPre(
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _BYTE_LEVEL])
    ),
    "llama-bpe": _LLAMA3_PRE,
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "dbrx": _CL100K_PRE,
    "smaug-bpe": _CL100K_PRE,
    # Qwen 2, 2.5, 3 and Qwen3-MoE; their tokenizer.json normalizes to NFC first (llama.cpp does not, so it
    # differs from the original on decomposed text such as "e\u0301").
    "qwen2": _ByteLevelPre(_regex_splits(_QWEN2_REGEX), normalizer=normalizers.NFC()),
    "deepseek-r1-qwen": _ByteLevelPre(_regex_splits(_QWEN2_REGEX)),  # DeepSeek-R1-Distill-Qwen
    "tekken": _ByteLevelPre(_regex_splits(_TEKKEN_REGEX), ignore_merges=True, add_bos=True),
}

_SAVE_EOS_KEY = "jaxinfer_eos_token_ids"  # exact eos ids, so from_hf(save()) restores them unchanged


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str  # tokenizer.ggml.pre: the pre-tokenizer name ("smollm", "default" ...)
    tokens: list[str]  # [n_vocab]
    types: np.ndarray  # [n_vocab] int32, TOKEN_* values
    scores: np.ndarray | None  # [n_vocab] float32 (SentencePiece vocabularies)
    merges: list[str] | None  # ["a b", ...] (BPE vocabularies)
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_space_prefix: bool
    chat_template: str | None

    @classmethod
    def read(cls, path: str | os.PathLike[str], *, reader: gguf.GGUFReader | None = None) -> GGUFVocab:
        if reader is None:
            path = Path(path)
            if not path.is_file():
                raise ValueError(f"{path=} is not a file")
            from jaxinfer.loading.gguf_loader import open_gguf  # the fast reader, one parse for both

            reader = open_gguf(path)
        fields = reader.fields
        if "tokenizer.ggml.model" not in fields or "tokenizer.ggml.tokens" not in fields:
            raise ValueError(f"{path} lacks tokenizer metadata (tokenizer.ggml.model, tokenizer.ggml.tokens)")

        def scalar(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        def strings(key: str) -> list[str] | None:
            if key not in fields:
                return None
            field = fields[key]
            # contents() is fine too, but this direct read is ~10x faster on 262k entries.
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]

        def numbers(key: str, dtype: type) -> np.ndarray | None:
            if key not in fields:
                return None
            field = fields[key]
            return np.concatenate([field.parts[i] for i in field.data]).astype(dtype)

        tokens = strings("tokenizer.ggml.tokens")
        n_vocab = len(tokens)
        types = numbers("tokenizer.ggml.token_type", np.int32)
        if types is None:
            types = np.full([n_vocab], TOKEN_NORMAL, np.int32)
        scores = numbers("tokenizer.ggml.scores", np.float32)
        for name, array in [("token_type", types), ("scores", scores)]:
            if array is not None and len(array) != n_vocab:
                raise ValueError(f"{path}: tokenizer.ggml.{name} has {len(array)} entries, not {n_vocab=}")

        def token_id(key: str) -> int | None:
            value = scalar(key)
            if value is None:
                return None
            if not 0 <= int(value) < n_vocab:
                raise ValueError(f"{path}: {key}={value} is outside the vocabulary ({n_vocab=})")
            return int(value)

        model = str(scalar("tokenizer.ggml.model"))
        pre = str(scalar("tokenizer.ggml.pre", "default"))
        bos_id = token_id("tokenizer.ggml.bos_token_id")
        # llama.cpp's defaults where metadata is silent: SentencePiece models add BOS, BPE ones only for the
        # pre-tokenizers that say so (Llama 3's), and only where a BOS token is declared.
        byte_level_pre = _BYTE_LEVEL_PRE_TOKENIZERS.get(pre) if model == "gpt2" else None
        default_add_bos = model == "llama" or (
            byte_level_pre is not None and byte_level_pre.add_bos and bos_id is not None
        )
        return cls(
            model=model,
            pre=pre,
            tokens=tokens,
            types=types,
            scores=scores,
            merges=strings("tokenizer.ggml.merges"),
            bos_id=bos_id,
            eos_id=token_id("tokenizer.ggml.eos_token_id"),
            eot_id=token_id("tokenizer.ggml.eot_token_id"),
            unk_id=token_id("tokenizer.ggml.unknown_token_id"),
            pad_id=token_id("tokenizer.ggml.padding_token_id"),
            add_bos=bool(scalar("tokenizer.ggml.add_bos_token", default_add_bos)),
            add_space_prefix=bool(scalar("tokenizer.ggml.add_space_prefix", model == "llama")),
            chat_template=scalar("tokenizer.chat_template"),
        )


class _Backend(Protocol):
    """What Tokenizer needs from a vocabulary implementation. ids never include an automatic BOS."""

    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special: bool) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, token_id: int) -> str: ...
    def is_special(self, token_id: int) -> bool: ...
    def save(self, directory: Path) -> str: ...  # returns the file name it wrote


class _HFTokenizersBackend:
    """A `tokenizers.Tokenizer` (byte-level BPE, or any tokenizer.json)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    def adds_bos_itself(self, bos_id: int) -> bool:
        """Whether the tokenizer.json post-processor prepends BOS (how HF folders say add_bos_token)."""
        return self._tokenizer.encode("a", add_special_tokens=True).ids[:1] == [bos_id]

    def save(self, directory: Path) -> str:
        self._tokenizer.save(str(directory / "tokenizer.json"))
        return "tokenizer.json"


class _SentencePieceBackend:
    """A SentencePiece model; control and unknown pieces are split out of the text before encoding.

    SentencePiece itself never produces a control piece from text, and decodes `<unk>` as " ⁇ ".
    """

    def __init__(self, model_proto: bytes):
        self._proto_bytes = model_proto
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.vocab_size = self._sp.get_piece_size()
        self._special_ids = frozenset(
            i for i in range(self.vocab_size) if self._sp.is_control(i) or self._sp.is_unknown(i)
        )
        self._special_by_text = {self._sp.id_to_piece(i): i for i in self._special_ids}
        # Longest first, so "<unused10>" wins over a shorter special that is its prefix.
        alternatives = sorted(self._special_by_text, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def encode(self, text: str) -> list[int]:
        if self._special_pattern is None:
            return self._sp.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            if match.start() > start:
                ids += self._sp.encode(text[start : match.start()])
            ids.append(self._special_by_text[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._sp.encode(text[start:])
        return ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if not any(i in self._special_ids for i in ids):
            return self._sp.decode(ids)
        # Decode the runs between special tokens; byte-fallback sequences never straddle a special token.
        parts, run = [], []
        for i in ids:
            if i in self._special_ids:
                parts.append(self._sp.decode(run))
                run = []
                if not skip_special:
                    parts.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        parts.append(self._sp.decode(run))
        return "".join(parts)

    def token_bytes(self) -> list[bytes]:
        """Each piece's bytes: "▁" is a space, byte-fallback pieces "<0xNN>" are that byte."""
        out = []
        for i in range(self.vocab_size):
            piece = self._sp.id_to_piece(i)
            if self._sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out

    def token_to_id(self, token: str) -> int | None:
        token_id = self._sp.piece_to_id(token)  # unknown pieces map to unk_id
        return token_id if self._sp.id_to_piece(token_id) == token else None

    def id_to_token(self, token_id: int) -> str:
        return self._sp.id_to_piece(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def default_special_ids(self) -> tuple[int | None, int | None]:
        """(bos, eos) declared in the model's trainer spec; None where disabled."""
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        return (bos if bos >= 0 else None), (eos if eos >= 0 else None)

    def save(self, directory: Path) -> str:
        (directory / "tokenizer.model").write_bytes(self._proto_bytes)
        return "tokenizer.model"


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop tokens.

    Thread-safe for concurrent encode/decode (the backends hold no per-call state).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        add_bos: bool,
        chat_template: str | None = None,
    ):
        self._backend = backend
        self.vocab_size: int = backend.vocab_size
        for name, token_id in [("bos_id", bos_id), *((f"eos_ids[{i}]", e) for i, e in enumerate(eos_ids))]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{name}={token_id} is outside the vocabulary ({self.vocab_size=})")
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True but the vocabulary has no BOS token (bos_id=None)")
        if not eos_ids:
            raise ValueError("eos_ids is empty: generation would never stop on a token")
        self.bos_id: int | None = bos_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))  # deduplicated, declared eos first
        self.add_bos: bool = bool(add_bos)
        self._chat_template_source = chat_template or None
        self._chat_template = ChatTemplate(chat_template) if chat_template else None
        self.has_chat_template: bool = self._chat_template is not None
        self.bos_token: str = backend.id_to_token(bos_id) if bos_id is not None else ""
        self.eos_token: str = backend.id_to_token(self.eos_ids[0])

    def __repr__(self) -> str:
        return (
            f"Tokenizer({type(self._backend).__name__}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={self.eos_ids}, add_bos={self.add_bos}, has_chat_template={self.has_chat_template})"
        )

    # ---- text <-> ids

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of text; prepends BOS when add_bos (default: the model's own setting) is true."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("text is empty: nothing to encode")
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True but this vocabulary has no BOS token")
        ids = self._backend.encode(text)
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ids; control tokens (BOS, <|im_end|> ...) are dropped when skip_special. [] gives ""."""
        return self._backend.decode(self._checked_ids(ids), skip_special)

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry given as its stored text, or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The stored text of one vocabulary entry (byte-level or "▁" escaped, as in the vocabulary)."""
        return self._backend.id_to_token(self._checked_ids([token_id])[0])

    def is_special(self, token_id: int) -> bool:
        """Whether token_id is a control token that decode(skip_special=True) drops."""
        return self._backend.is_special(token_id)

    def hf_tokenizer_json(self) -> str | None:
        """The tokenizer.json text of a Hugging Face tokenizers vocabulary, else None (structured
        output builds its token table from it, or from token_bytes())."""
        backend = self._backend
        return backend.to_json() if isinstance(backend, _HFTokenizersBackend) else None

    def token_bytes(self) -> list[bytes]:
        """Each token's bytes (SentencePiece vocabularies)."""
        return self._backend.token_bytes()

    def detokenizer(self, *, skip_special: bool = True) -> IncrementalDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        return IncrementalDetokenizer(lambda ids: self.decode(ids, skip_special=skip_special))

    def _checked_ids(self, ids: Sequence[int]) -> list[int]:
        if isinstance(ids, (str, bytes)):
            raise ValueError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        checked = []
        for i in ids:
            if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
                raise ValueError(f"token ids must be ints, got {i!r} ({type(i).__name__})")
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {int(i)} is outside the vocabulary ({self.vocab_size=})")
            checked.append(int(i))
        return checked

    # ---- chat

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt for messages ([{"role": ..., "content": ...}]) as the model's template writes it."""
        if self._chat_template is None:
            raise ValueError("this model has no chat template (its metadata has no tokenizer.chat_template)")
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat; BOS is added only if the model wants it and the template didn't."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        template_wrote_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_bos=self.add_bos and not template_wrote_bos)

    # ---- loading and saving

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, reader: Any | None = None) -> Tokenizer:
        """Builds the tokenizer from a GGUF file's `tokenizer.*` metadata.

        Pass `reader` (a `gguf.GGUFReader` of the same file) to reuse one that is already open: parsing the
        metadata of a 262k-entry vocabulary takes ~10 s on a small CPU.
        """
        vocab = GGUFVocab.read(path, reader=reader)
        if vocab.model == "gpt2":
            backend: _Backend = _HFTokenizersBackend(_byte_level_bpe(vocab))
        elif vocab.model == "llama":
            backend = _SentencePieceBackend(_sentencepiece_proto(vocab))
        else:
            raise ValueError(f"{path}: unsupported tokenizer model tokenizer.ggml.model={vocab.model!r}")
        eos_ids = [i for i in (vocab.eos_id, vocab.eot_id) if i is not None]
        if vocab.bos_id is None and vocab.add_bos:
            raise ValueError(f"{path}: tokenizer.ggml.add_bos_token is true but there is no bos_token_id")
        return cls(
            backend,
            bos_id=vocab.bos_id,
            eos_ids=eos_ids + _end_of_turn_ids(backend),
            add_bos=vocab.add_bos,
            chat_template=vocab.chat_template,
        )

    @classmethod
    def from_hf(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Loads a Hugging Face tokenizer folder: tokenizer.json or tokenizer.model, tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja and generation_config.json where present."""
        directory = Path(directory)
        if not directory.is_dir():
            raise ValueError(f"{directory=} is not a directory")
        config = _read_json(directory / "tokenizer_config.json")
        special_map = _read_json(directory / "special_tokens_map.json")
        generation = _read_json(directory / "generation_config.json")

        if (directory / "tokenizer.json").is_file():
            tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
            backend: _Backend = _HFTokenizersBackend(tokenizer)
            default_bos = default_eos = None
        elif (directory / "tokenizer.model").is_file():
            backend = _SentencePieceBackend((directory / "tokenizer.model").read_bytes())
            default_bos, default_eos = backend.default_special_ids()
        else:
            raise ValueError(f"{directory} has neither tokenizer.json nor tokenizer.model")

        def special_id(name: str, default: int | None) -> int | None:
            token = _token_content(config.get(name, special_map.get(name)))
            if token is None:
                return default
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"{directory}: {name}={token!r} is not in the vocabulary")
            return token_id

        bos_id = special_id("bos_token", default_bos)
        if _SAVE_EOS_KEY in config:
            eos_ids = [int(i) for i in config[_SAVE_EOS_KEY]]
        else:
            eos_id = special_id("eos_token", default_eos)
            generation_eos = generation.get("eos_token_id")
            generation_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
            eos_ids = [i for i in [eos_id, *generation_eos] if i is not None] + _end_of_turn_ids(backend)
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"]) and bos_id is not None
        elif isinstance(backend, _HFTokenizersBackend):
            add_bos = bos_id is not None and backend.adds_bos_itself(bos_id)
        else:
            add_bos = bos_id is not None  # SentencePiece (Llama / Gemma) models start with BOS
        chat_template = _chat_template(directory, config)
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=add_bos, chat_template=chat_template)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Writes a Hugging Face style folder (tokenizer.json or tokenizer.model, tokenizer_config.json)."""
        directory = Path(directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"{directory=} exists and is not a directory")
        directory.mkdir(parents=True, exist_ok=True)
        written = self._backend.save(directory)
        config: dict[str, Any] = {
            "add_bos_token": self.add_bos,
            "bos_token": self.bos_token or None,
            "eos_token": self.eos_token,
            _SAVE_EOS_KEY: list(self.eos_ids),
        }
        if written == "tokenizer.json":
            config["tokenizer_class"] = "PreTrainedTokenizerFast"  # lets transformers load the folder too
        if self._chat_template_source is not None:
            config["chat_template"] = self._chat_template_source
        config_text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (directory / "tokenizer_config.json").write_text(config_text, encoding="utf-8")


# ---- building backends from GGUF vocabularies


def _byte_level_bpe(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """Byte-level BPE (GPT-2 style) from a GGUF vocabulary: [n_vocab] tokens and merges "a b"."""
    if vocab.merges is None:
        raise ValueError("GGUF gpt2 tokenizer has no tokenizer.ggml.merges")
    pre = _BYTE_LEVEL_PRE_TOKENIZERS.get(vocab.pre)
    if pre is None:
        known = ", ".join(sorted(_BYTE_LEVEL_PRE_TOKENIZERS))
        raise ValueError(f"unsupported byte-level pre-tokenizer tokenizer.ggml.pre={vocab.pre!r} ({known=})")
    merges = []
    for merge in vocab.merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"malformed GGUF merge {merge!r}: expected two tokens separated by a space")
        merges.append((left, right))
    token_ids = {token: i for i, token in enumerate(vocab.tokens)}
    model = tokenizers.models.BPE(
        vocab=token_ids, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges
    )
    tokenizer = tokenizers.Tokenizer(model)
    if pre.normalizer is not None:
        tokenizer.normalizer = pre.normalizer
    tokenizer.pre_tokenizer = pre.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(vocab.tokens[i], special=vocab.types[i] == TOKEN_CONTROL, normalized=False)
        for i in np.flatnonzero((vocab.types == TOKEN_CONTROL) | (vocab.types == TOKEN_USER_DEFINED))
    ]
    tokenizer.add_special_tokens([t for t in added if t.special])
    tokenizer.add_tokens([t for t in added if not t.special])
    if vocab.add_bos and vocab.bos_id is not None:
        # Only for transformers reading a saved folder; our own encode() adds BOS itself.
        bos = vocab.tokens[vocab.bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_id)]
        )
    return tokenizer


def _sentencepiece_proto(vocab: GGUFVocab) -> bytes:
    """A serialized SentencePiece BPE ModelProto from a GGUF "llama" vocabulary (tokens, scores, types)."""
    if vocab.scores is None:
        raise ValueError("GGUF llama tokenizer has no tokenizer.ggml.scores")
    proto = sentencepiece_model_pb2.ModelProto()
    trainer = proto.trainer_spec
    trainer.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(vocab.tokens)
    trainer.byte_fallback = bool(np.any(vocab.types == TOKEN_BYTE))
    unk_id = vocab.unk_id
    if unk_id is None:  # llama.cpp's SentencePiece default: id 0 (here the UNKNOWN-typed piece, if any)
        unknown = np.flatnonzero(vocab.types == TOKEN_UNKNOWN)
        unk_id = int(unknown[0]) if len(unknown) else 0
    for field, token_id in [
        ("unk_id", unk_id),
        ("bos_id", vocab.bos_id),
        ("eos_id", vocab.eos_id),
        ("pad_id", vocab.pad_id),
    ]:
        setattr(trainer, field, -1 if token_id is None else token_id)
    normalizer = proto.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = vocab.add_space_prefix
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    types = vocab.types.copy()
    types[unk_id] = TOKEN_UNKNOWN  # SentencePiece requires exactly one UNKNOWN piece
    for token, score, token_type in zip(vocab.tokens, vocab.scores.tolist(), types.tolist(), strict=True):
        piece = proto.pieces.add()
        # llama.cpp stores user-defined pieces with plain spaces; SentencePiece matches them in escaped text.
        piece.piece = token.replace(" ", "▁") if token_type == TOKEN_USER_DEFINED else token
        piece.score = score
        piece.type = token_type
    return proto.SerializeToString()


# ---- small helpers


def _end_of_turn_ids(backend: _Backend) -> list[int]:
    ids = []
    for token in END_OF_TURN_TOKENS:
        token_id = backend.token_to_id(token)
        if token_id is not None and backend.is_special(token_id):
            ids.append(token_id)
    return ids


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any) -> str | None:
    """A special token entry of tokenizer_config.json: "<bos>" or {"content": "<bos>", ...} or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    template_file = directory / "chat_template.jinja"  # where transformers >= 4.50 saves it
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
