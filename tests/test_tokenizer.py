"""jaxinfer.tokenizer against transformers' GGUF tokenizers on the two embedded models.

Reference: transformers `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, with two documented fixes:

* SmolLM2: transformers' GGUF converter gives the byte-level BPE a plain ByteLevel pre-tokenizer and drops
  SmolLM2's individual-digit split (GGUF `tokenizer.ggml.pre == "smollm"`). The reference's pre-tokenizer is
  patched back to Sequence[Digits(individual_digits=True), ByteLevel]; the unpatched one is kept to show the
  trap (it differs wherever whitespace precedes a digit).
* Gemma 3: transformers turns the user-defined whitespace pieces ("▁" x 2..31, "\n" x 1..31) into BPE merges,
  so runs longer than 31 split differently (40 spaces: 16 + 24) from SentencePiece and llama.cpp, which match
  user-defined pieces greedily (31 + 9). The shared text set keeps runs <= 31; a separate test checks the
  greedy split against the GGUF vocabulary itself.

Both GGUF files are parsed once per process (Gemma's 262k-token vocabulary is most of a header) and the
reader is shared with the reference loader.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
from sentencepiece import sentencepiece_model_pb2
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from jaxinfer.detokenizer import IncrementalDetokenizer
from jaxinfer.loading.gguf_loader import open_gguf
from jaxinfer.registry import resolve_model
from jaxinfer.tokenizer import TOKEN_USER_DEFINED, Tokenizer

MODELS = ["smollm2-135m-instruct", "gemma3-270m"]

TEXTS = [
    # code
    "def f(x):\n    return x**2  # square\n",
    'for (int i = 0; i < 10; ++i) {\n\tprintf("%d\\n", i);\n}',
    "SELECT * FROM t WHERE id IN (1, 22, 333);",
    # digit runs, and digits right after whitespace (where SmolLM2's digit split matters)
    "3.14159 2024-11-30 1000000 007 x   1 \t\t3 a\n\n2 value:  42",
    "    123\n        4567",
    # whitespace runs
    "x  y   z    w\t\tv\n\n\nu",
    "   leading and trailing   ",
    "  \n  \n\r\n\t \t",
    " " * 31 + "x" + "\n" * 20,
    # non-Latin scripts
    "日本語のテキスト、中文文本和汉字。",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Привет, мир! Ελληνικά κείμενα.",
    # emoji (ZWJ sequences, flags) and characters Gemma has no piece for (byte fallback)
    "emoji 😀🎉👩‍👩‍👧 done 🇯🇵 🧿",
    "rare 𓀀 🦩 ꙮ 𝔘 ⱦ",
    # accented and compatibility characters
    "Café naïve résumé Ångström Ｆｕｌｌｗｉｄｔｈ ﬁ ½ ①",
    # chat markup with control tokens (each model's own, and the other's as plain text)
    "<|im_start|>user\nHi there 12<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>",
    "<bos>text<eos> <b>bold</b> <code>x</code>",
]


@contextlib.contextmanager
def _shared_gguf_reader(path: Path, reader: gguf.GGUFReader):
    """Lets transformers reuse our already parsed GGUFReader of the same file (it imports gguf.GGUFReader
    inside its loader, so patching the module attribute is enough)."""
    original = gguf.GGUFReader

    def reader_for(p, *args, **kwargs):
        return reader if Path(p) == path else original(p, *args, **kwargs)

    gguf.GGUFReader = reader_for
    try:
        yield
    finally:
        gguf.GGUFReader = original


class Loaded:
    def __init__(self, name: str):
        self.name = name
        _, self.path = resolve_model(name)
        self.reader = open_gguf(self.path)  # the fast reader, parsed once per process
        self.ours = Tokenizer.from_gguf(self.path, reader=self.reader)
        with _shared_gguf_reader(self.path, self.reader):
            self.ref = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        self.unpatched_backend = tokenizers.Tokenizer.from_str(self.ref.backend_tokenizer.to_str())
        if name == "smollm2-135m-instruct":
            self.ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )

    def field(self, key: str):
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()


_LOADED: dict[str, Loaded] = {}


def _load(name: str) -> Loaded:
    # One load per model for the whole file: the parametrized and the per-model fixtures share it.
    if name not in _LOADED:
        _LOADED[name] = Loaded(name)
    return _LOADED[name]


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> Loaded:
    return _load(request.param)


@pytest.fixture(scope="module")
def smol() -> Loaded:
    return _load(MODELS[0])


@pytest.fixture(scope="module")
def gemma() -> Loaded:
    return _load(MODELS[1])


# ---- ids against the reference


def test_encode_matches_reference(model: Loaded):
    for text in TEXTS:
        assert model.ours.encode(text) == model.ref(text).input_ids, text
        assert model.ours.encode(text, add_bos=False) == model.ref(text, add_special_tokens=False).input_ids
        assert model.ours.encode(text, add_bos=True)[0] == model.ref.bos_token_id


def test_smollm2_reference_drops_digit_split_trap(smol: Loaded):
    """transformers' GGUF tokenizer for SmolLM2 lacks the Digits pre-tokenizer the GGUF asks for."""
    assert smol.field("tokenizer.ggml.pre") == "smollm"
    assert json.loads(smol.unpatched_backend.to_str())["pre_tokenizer"]["type"] == "ByteLevel"
    differing = [
        text
        for text in TEXTS
        if smol.unpatched_backend.encode(text, add_special_tokens=False).ids != smol.ours.encode(text)
    ]
    assert any(any(ch.isdigit() for ch in text) for text in differing), differing
    # Whitespace before a digit is where it shows: the unpatched split leaves a lone "Ġ" before the digit.
    text = "x   1"
    unpatched = smol.unpatched_backend.encode(text, add_special_tokens=False).ids
    assert unpatched != smol.ours.encode(text) == smol.ref(text).input_ids
    assert smol.ref.decode(unpatched) == smol.ours.decode(smol.ours.encode(text)) == text


def test_gemma_long_whitespace_runs_split_greedily(gemma: Loaded):
    """Runs longer than the longest user-defined whitespace piece: greedy longest match, as SentencePiece."""
    field = gemma.reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    types = np.asarray(gemma.reader.fields["tokenizer.ggml.token_type"].contents())
    for char in [" ", "\n"]:
        run_ids = {
            len(token): i
            for i, token in enumerate(tokens)
            if types[i] == TOKEN_USER_DEFINED and set(token) == {char}
        }
        text = char * 40 + "x"
        expected, left = [], 40
        while left:
            length = max(n for n in run_ids if n <= left)
            expected.append(run_ids[length])
            left -= length
        expected.append(gemma.ours.token_to_id("x"))
        ids = gemma.ours.encode(text, add_bos=False)
        assert ids == expected
        assert gemma.ours.decode(ids) == text
        assert gemma.ref.decode(gemma.ref(text, add_special_tokens=False).input_ids) == text


def test_control_tokens_encode_to_single_ids(model: Loaded):
    if model.name == "smollm2-135m-instruct":
        names = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    else:
        names = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]
    for name in names:
        token_id = model.ref.convert_tokens_to_ids(name)
        assert model.ours.encode(name, add_bos=False) == [token_id]
        assert model.ours.is_special(token_id)
        assert model.ours.decode([token_id]) == ""
        assert model.ours.decode([token_id], skip_special=False) == name


def test_special_ids_follow_metadata(model: Loaded):
    ours = model.ours
    assert ours.vocab_size == len(model.reader.fields["tokenizer.ggml.tokens"].data) == len(model.ref)
    assert ours.bos_id == model.field("tokenizer.ggml.bos_token_id") == model.ref.bos_token_id
    assert ours.add_bos == model.field("tokenizer.ggml.add_bos_token")
    assert ours.eos_ids[0] == model.field("tokenizer.ggml.eos_token_id") == model.ref.eos_token_id
    end_of_turn = "<|im_end|>" if "<|im_end|>" in model.ref.get_vocab() else "<end_of_turn>"
    assert model.ref.convert_tokens_to_ids(end_of_turn) in ours.eos_ids
    assert all(ours.is_special(i) for i in ours.eos_ids)


# ---- decoding


def test_decode_round_trips(model: Loaded):
    for text in TEXTS:
        ids = model.ours.encode(text)
        assert (
            model.ours.decode(ids, skip_special=False)
            == (model.ours.bos_token if model.ours.add_bos else "") + text
        )
        without_special = model.ours.decode(ids)
        assert without_special == model.ref.decode(ids, skip_special_tokens=True)
        assert model.ours.decode(ids, skip_special=False) == model.ref.decode(ids, skip_special_tokens=False)


def _stream(detokenizer: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(i) for i in ids] + [detokenizer.flush()]


def test_incremental_detokenizer_equals_decode(model: Loaded):
    held_back = False
    for text in TEXTS:
        ids = model.ours.encode(text)
        for skip_special in (True, False):
            detokenizer = model.ours.detokenizer(skip_special=skip_special)
            pieces = _stream(detokenizer, ids)
            assert "".join(pieces) == detokenizer.text == model.ours.decode(ids, skip_special=skip_special)
            for piece in pieces:
                assert "\ufffd" not in piece, (text, pieces)
                piece.encode("utf-8")  # no lone surrogates
            # A token that is only part of a character must not emit anything yet.
            naive = [model.ours.decode([i]) for i in ids]
            held_back |= any("\ufffd" in n for n in naive) and "" in pieces[:-1]
    assert held_back, "no text in the set splits a character across tokens"


def test_incremental_detokenizer_keeps_dummy_prefix_space_mid_stream(gemma: Loaded, tmp_path: Path):
    """A SentencePiece model with a dummy prefix drops the "▁" of a sequence's first piece when decoding;
    the detokenizer must not drop it from pieces in the middle of the stream."""
    gemma.ours.save(tmp_path)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((tmp_path / "tokenizer.model").read_bytes())
    proto.normalizer_spec.add_dummy_prefix = True
    (tmp_path / "tokenizer.model").write_bytes(proto.SerializeToString())
    llama_style = Tokenizer.from_hf(tmp_path)
    text = "Hello world, this is a test of spaces 😀 and 𓀀 bytes"
    ids = llama_style.encode(text, add_bos=False)
    naive = "".join(llama_style.decode([i]) for i in ids)
    assert naive.startswith("Helloworld,thisis")  # decoding one token at a time loses every space
    assert llama_style.decode(ids) == text
    assert "".join(_stream(llama_style.detokenizer(), ids)) == text


def test_incremental_detokenizer_invalid_bytes_and_window(gemma: Loaded):
    byte_id = gemma.ours.token_to_id
    # A lone lead byte then text: decode() shows U+FFFD, and the stream must agree with it at the end.
    ids = [byte_id("<0xE4>"), byte_id("<0xB8>"), byte_id("a"), byte_id("<0xFF>")]
    assert "".join(_stream(gemma.ours.detokenizer(), ids)) == gemma.ours.decode(ids)
    # The decoded window stays short however long the stream is (O(1) work per token).
    windows = []

    def decode(window):
        windows.append(len(window))
        return gemma.ours.decode(window)

    ids = gemma.ours.encode(" ".join(TEXTS) * 4, add_bos=False)
    detokenizer = IncrementalDetokenizer(decode)
    assert "".join(_stream(detokenizer, ids)) == gemma.ours.decode(ids)
    assert len(ids) > 500 and max(windows) <= 8


# ---- chat templates


CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3:\n1"},
    ],
]


def test_smollm2_chat_template_matches_transformers(smol: Loaded):
    assert smol.ours.has_chat_template and smol.field("tokenizer.chat_template")
    for messages in CHATS:
        for add_generation_prompt in (True, False):
            expected = smol.ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            rendered = smol.ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert rendered == expected
            ids = smol.ours.encode_chat(messages, add_generation_prompt=add_generation_prompt)
            assert ids == smol.ref(expected, add_special_tokens=False).input_ids


def test_gemma_270m_has_no_chat_template(gemma: Loaded):
    assert "tokenizer.chat_template" not in gemma.reader.fields
    assert gemma.ref.chat_template is None
    assert not gemma.ours.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        gemma.ours.apply_chat_template(CHATS[0])


# ---- saving and loading Hugging Face folders


def _same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    assert (a.vocab_size, a.bos_id, a.eos_ids, a.add_bos, a.has_chat_template) == (
        b.vocab_size,
        b.bos_id,
        b.eos_ids,
        b.add_bos,
        b.has_chat_template,
    )
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids
        assert b.decode(ids) == a.decode(ids)
    if a.has_chat_template:
        assert all(a.encode_chat(m) == b.encode_chat(m) for m in CHATS)


def test_save_then_from_hf_round_trips(model: Loaded, tmp_path: Path):
    model.ours.save(tmp_path)
    _same_tokenizer(model.ours, Tokenizer.from_hf(tmp_path))
    if (tmp_path / "tokenizer.json").is_file():  # transformers reads the folder as well
        reloaded = AutoTokenizer.from_pretrained(tmp_path)
        assert all(
            reloaded(t, add_special_tokens=False).input_ids == model.ours.encode(t, add_bos=False)
            for t in TEXTS
        )


def test_from_hf_reads_reference_save_pretrained(model: Loaded, tmp_path: Path):
    model.ref.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf(tmp_path)
    assert (loaded.bos_id, loaded.add_bos, loaded.has_chat_template) == (
        model.ours.bos_id,
        model.ours.add_bos,
        model.ours.has_chat_template,
    )
    assert set(model.ours.eos_ids) <= set(loaded.eos_ids)
    for text in TEXTS:
        assert loaded.encode(text) == model.ref(text).input_ids == model.ours.encode(text), text
    if loaded.has_chat_template:
        for messages in CHATS:
            assert loaded.apply_chat_template(messages) == model.ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )


# ---- input validation


def test_invalid_inputs_raise_value_error(smol: Loaded, tmp_path: Path):
    tok = smol.ours
    bad_calls = [
        (lambda: tok.encode(""), "empty"),
        (lambda: tok.encode(b"bytes"), "str"),
        (lambda: tok.decode([tok.vocab_size]), "outside the vocabulary"),
        (lambda: tok.decode([-1]), "outside the vocabulary"),
        (lambda: tok.decode(["a"]), "ints"),
        (lambda: tok.decode("abc"), "sequence of ints"),
        (lambda: tok.apply_chat_template([]), "empty"),
        (lambda: tok.apply_chat_template([{"content": "x"}]), "role"),
        (lambda: tok.apply_chat_template([{"role": "user", "content": 3}]), "content"),
        (lambda: tok.detokenizer().add(tok.vocab_size), "outside the vocabulary"),
        (lambda: Tokenizer.from_gguf(tmp_path / "missing.gguf"), "not a file"),
        (lambda: Tokenizer.from_hf(tmp_path), "neither tokenizer.json nor tokenizer.model"),
        (lambda: Tokenizer.from_hf(tmp_path / "missing"), "not a directory"),
    ]
    for call, message in bad_calls:
        with pytest.raises(ValueError, match=message):
            call()
    # A template's own raise_exception becomes a ValueError carrying its message.
    tok.save(tmp_path / "saved")
    config_path = tmp_path / "saved" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    strict = Tokenizer.from_hf(tmp_path / "saved")
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == ""
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
