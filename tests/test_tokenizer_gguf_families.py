"""GGUF tokenizers of the model families, on vocabularies trained here (no hub), against the library each
original runs in.

* Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): a small BPE is trained with the `tokenizers` library
  behind each family's own pre-tokenizer, written as its tokenizer.json file writes it (Llama 3, Qwen 2,
  GPT-2, SmolLM), or as llama.cpp's src/llama-vocab.cpp defines it where no tokenizer.json does ("default").
  Its tokens, merges and token types go into a GGUF file as llama.cpp's converter writes them, with the
  `tokenizer.ggml.pre` name the converter gives that family; `Tokenizer.from_gguf` must give the trained
  tokenizer's ids.
* SentencePiece (`tokenizer.ggml.model == "llama"`: Llama 2, Mistral, Phi-3, Gemma): a small BPE model with
  byte fallback is trained with `sentencepiece`, normalizing as those models do (identity, whitespace kept),
  with and without the dummy prefix; it is written as llama.cpp's converter writes it (pieces, scores,
  types, control and user-defined tokens, `tokenizer.ggml.add_space_prefix`), and our ids must equal the
  original processor's. Control tokens are split out of the text first, each fragment encoded on its own,
  as llama.cpp does.

The strings checked share no line with the training text.
"""

from __future__ import annotations

import io
import json
import unicodedata
from pathlib import Path

import gguf
import pytest
import sentencepiece
import tokenizers
from tokenizers import trainers

from jaxinfer.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps on the warm windowsill.
I don't know whether they're coming, but we'll see; she'd said it's fine and you've agreed.
WE'LL MEET AT NOON. THEY'RE LATE. It'S fine, I'M sure, YOU'VE got this, he'D better hurry.
In 2023 the company shipped 12345 units, up 17% from 10552 units; revenue was $3,141,592.65.
Call 555-0199 or 800 123 4567 before 11:59 pm on 2024-12-31. Version 3.10.12 fixed bug #4521.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
class Stack:
    def __init__(self):
        self.items = []  # the storage

    def push(self, item):
        self.items.append(item)
int main(void) { for (int i = 0; i < 100; i++) { printf("%d\\n", i * i); } return 0; }
const total = values.reduce((acc, v) => acc + v, 0); if (total !== 0 && !done) { emit(total); }
SELECT name, COUNT(*) FROM users WHERE age >= 21 GROUP BY name ORDER BY 2 DESC;
    indented    text  with   irregular     spacing\t\tand\ttabs
trailing spaces here\x20\x20\x20\x20
\t\tdouble tab then text


three blank lines above; windows line\r\nending here\r\n
東京は日本の首都であり、多くの人々が住んでいます。私は毎朝コーヒーを飲みます。
我们今天去公园散步，天气非常好。学习中文需要很多时间和耐心。
서울은 대한민국의 수도입니다. 오늘 날씨가 좋네요.
Привет, как дела? Сегодня хорошая погода. Ελληνικά: καλημέρα κόσμε.
Emoji time 😀😃😄 🎉🎊 👍🏽 ❤️ 🚀 and the family 👨‍👩‍👧‍👦 with flags 🇺🇸🇯🇵.
Café, naïve, résumé, jalapeño, Ångström, façade, coöperate, São Paulo, Zürich.
Punctuation!!! Really??? Wait... (nested [brackets {here}]) -- dashes — and “quotes” ‘too’.
Math: x^2 + y^2 = z^2, a <= b, c != d, e >= f, 1/2 + 1/3 = 5/6, ∑ ∫ √ π ≈ 3.14159.
"""
# Repeated so that merges form; the BPE trainers see these lines many times.
TRAINING_LINES = CORPUS.splitlines(keepends=True) * 8

BATTERY = [
    "Hello there, how are you doing today?",
    "Don't stop; I'll've done it by then. SHE'S HERE, isn't she? we'D LIKE that",
    "1234567 89 0 3.14159265 1,000,000 v2.0.1 2025-01-02 007",
    "x   1 \t\t3 a\n\n2 value:  42 ratio=3/4",
    "a  b   c    d     e",
    "   leading and trailing   ",
    "\n\n\n\nfour newlines then text\r\n\r\ncrlf twice",
    " \n \n\t \t",
    "    ",
    "x",
    "def square(x):\n    return x * x  # squared\n\n\nprint(square(12))",
    "if (a >= 10 && b != 0) { c = a / b; } else { c = -1; }",
    "for (let i = 0; i < n; ++i) {\n\tconsole.log(`item ${i}`);\n}",
    "東京タワーは赤いです。我喜欢吃饺子。안녕하세요 여러분",
    "Добро пожаловать! Καλησπέρα σας.",
    "Hi 👋🏽 party 🎉🎉🎉 and 👩‍💻 coding 🧑‍🚀 🇫🇷",
    "rare 𓀀 🦩 ꙮ 𝔘 ⱦ ℌ ½ ﬁ",
    "naïve café in Zürich at 10:30 — “right?”",
    "Wait...what?!?! --- ok ===> done <<< $100 + 20% = |~^|",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    'before<tool_call>{"name": "f", "x": 12}</tool_call>after',
    "<|begin_of_text|>text<|end_of_text|> more",
]
assert set(BATTERY).isdisjoint(CORPUS.splitlines())
DECOMPOSED = "cafe\u0301 and nai\u0308ve"  # not NFC

SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]  # ids 0..3: BOS, EOS, ...
USER_DEFINED = "<tool_call>"  # an added token that is not special: llama.cpp's USER_DEFINED


# ---- byte-level BPE

# The pre-tokenizers (and normalizer, and BPE ignore_merges) of the families' tokenizer.json files.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


FAMILIES = {
    # tokenizer.ggml.pre: (normalizer, pre_tokenizer, ignore_merges), as in the family's tokenizer.json
    "llama-bpe": (  # Llama 3, 3.1, 3.2, 3.3
        None,
        {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]},
        True,
    ),
    "dbrx": (  # tiktoken cl100k_base vocabularies: OLMo 2, Phi-4 (and DBRX)
        None,
        {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]},
        False,
    ),
    "qwen2": (  # Qwen 2, 2.5, 3, Qwen3-MoE
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN2_SPLIT), _byte_level(False)]},
        False,
    ),
    "tekken": (  # Mistral NeMo, Small 3, Ministral (llama.cpp takes whole vocabulary words, as for Llama 3)
        None,
        {"type": "Sequence", "pretokenizers": [_split(_TEKKEN_SPLIT), _byte_level(False)]},
        True,
    ),
    "gpt-2": (None, _byte_level(True), False),
    "smollm": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
        },
        False,
    ),
    # llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: four regexes in turn, each isolating its matches.
    "default": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [
                _split(r"[\p{P}\$\+<=>\^~\|]+"),
                _split(_GPT2_SPLIT),
                _split(r"\p{N}+"),
                _split(r"[0-9][0-9][0-9]"),
                _byte_level(False),
            ],
        },
        False,
    ),
}
# llama.cpp's other names for the same splits.
ALIASES = {
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
    "smaug-bpe": "dbrx",
    "olmo": "gpt-2",
}


def _train_byte_level_bpe(normalizer: dict | None, pre_tokenizer: dict) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on CORPUS behind the given tokenizer.json parts, plus one added token that
    is not special."""
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_LINES, trainer=trainer)
    tokenizer.add_tokens([tokenizers.AddedToken(USER_DEFINED, special=False, normalized=False)])
    return tokenizer


def _behind(pre: str, vocabulary: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """The vocabulary and merges behind family `pre`'s normalizer, pre-tokenizer and ignore_merges."""
    normalizer, pre_tokenizer, ignore_merges = FAMILIES[pre]
    spec = json.loads(vocabulary.to_str())
    spec["normalizer"] = normalizer
    spec["pre_tokenizer"] = pre_tokenizer
    spec["model"]["ignore_merges"] = ignore_merges
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


def _write_byte_level_gguf(path: Path, hf: tokenizers.Tokenizer, pre: str, add_bos: bool | None) -> None:
    """The vocabulary as llama.cpp's converter writes it (convert_hf_to_gguf.py, _set_vocab_gpt2)."""
    model = json.loads(hf.to_str())["model"]
    vocab = hf.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    added = hf.get_added_tokens_decoder()
    types = [
        (TOKEN_CONTROL if added[i].special else TOKEN_USER_DEFINED) if i in added else TOKEN_NORMAL
        for i in range(len(tokens))
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|begin_of_text|>"])
    writer.add_eos_token_id(vocab["<|end_of_text|>"])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# Vocabularies: each family's own (trained behind its pre-tokenizer, as the real ones were), and a coarse
# one trained on whole lines, whose tokens cross every family's split boundaries (digit runs, " =", "\n\n",
# "'s" ...), so that a family's vocabulary read behind a wrong split shows up.
COARSE = "coarse"
_VOCABULARIES: dict[str, tokenizers.Tokenizer] = {}


def _vocabulary(name: str) -> tokenizers.Tokenizer:
    if name not in _VOCABULARIES:
        normalizer, pre_tokenizer = (None, _byte_level(False)) if name == COARSE else FAMILIES[name][:2]
        _VOCABULARIES[name] = _train_byte_level_bpe(normalizer, pre_tokenizer)
    return _VOCABULARIES[name]


def _from_gguf(
    tmp_path: Path, pre: str, vocabulary: str | None = None, *, family: str | None = None, add_bos=False
) -> tuple[tokenizers.Tokenizer, Tokenizer]:
    """(reference, ours): family `family` (default `pre`) over `vocabulary` (default its own), written to
    GGUF under the name `pre` and read back."""
    family = family or pre
    hf = _behind(family, _vocabulary(vocabulary or family))
    path = tmp_path / f"{pre}-{vocabulary}.gguf"
    _write_byte_level_gguf(path, hf, pre, add_bos)
    return hf, Tokenizer.from_gguf(path)


@pytest.mark.parametrize("vocabulary", ["own", COARSE])
@pytest.mark.parametrize("pre", list(FAMILIES))
def test_byte_level_bpe_matches_the_trained_tokenizer(pre: str, vocabulary: str, tmp_path: Path):
    hf, ours = _from_gguf(tmp_path, pre, None if vocabulary == "own" else vocabulary)
    for text in BATTERY:
        ids = ours.encode(text, add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False).ids, (pre, text)
        assert ours.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    # Control tokens are single ids; the user-defined token is one too, and decode keeps it.
    assert ours.encode("<|im_start|>", add_bos=False) == [SPECIAL.index("<|im_start|>")]
    user_id = hf.token_to_id(USER_DEFINED)
    assert ours.encode(USER_DEFINED, add_bos=False) == [user_id] and not ours.is_special(user_id)
    assert ours.decode([user_id]) == USER_DEFINED


@pytest.mark.parametrize("alias", list(ALIASES))
def test_byte_level_bpe_aliases(alias: str, tmp_path: Path):
    hf, ours = _from_gguf(tmp_path, alias, COARSE, family=ALIASES[alias])
    for text in BATTERY:
        expected = hf.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_bos=False) == expected, (alias, text)


def test_the_splits_differ_where_the_families_do():
    """The families' splits are not interchangeable: each differs from GPT-2's."""
    texts = {
        "llama-bpe": "1234567",  # digits in threes
        "qwen2": "value:  42",  # single digits
        "default": "x = y",  # "=" isolated, the space before it alone
        "tekken": "camelCaseWord",  # split at case changes
    }

    def pieces(pre: str, text: str) -> list[str]:
        return [piece for piece, _ in _behind(pre, _vocabulary(COARSE)).pre_tokenizer.pre_tokenize_str(text)]

    for pre, text in texts.items():
        assert pieces(pre, text) != pieces("gpt-2", text), pre
    assert pieces("llama-bpe", "1234567") == ["123", "456", "7"]
    assert pieces("qwen2", "1234567") == list("1234567")
    assert pieces("default", "x = 12345") == "x Ġ = Ġ 123 45".split()


def test_llama3_takes_whole_vocabulary_words_before_merges(tmp_path: Path):
    """ignore_merges: a pre-token that is a vocabulary entry is one token even where the merges, applied in
    rank order, would not reach it. A vocabulary is built where they would not."""
    spec = json.loads(_behind("llama-bpe", _vocabulary("llama-bpe")).to_str())
    vocab = spec["model"]["vocab"]
    # "Ġxq" is reachable only through "x q" (ranked last), while "Ġ x" merges first: merges give "Ġx", "q".
    spec["added_tokens"] = []
    assert "Ġx" in vocab and "xq" not in vocab
    for token in ["xq", "Ġxq"]:
        vocab[token] = max(vocab.values()) + 1
    spec["model"]["merges"] += [["x", "q"], ["Ġ", "xq"]]
    for flag in (False, True):
        spec["model"]["ignore_merges"] = flag
        built = tokenizers.Tokenizer.from_str(json.dumps(spec))
        path = tmp_path / f"ignore_merges_{flag}.gguf"
        _write_byte_level_gguf(path, built, "llama-bpe" if flag else "dbrx", add_bos=False)
        ours = Tokenizer.from_gguf(path)
        ids = built.encode(" xq", add_special_tokens=False).ids
        assert (ids == [vocab["Ġxq"]]) == flag
        assert ours.encode(" xq", add_bos=False) == ids


def test_qwen2_normalizes_to_nfc(tmp_path: Path):
    hf, ours = _from_gguf(tmp_path, "qwen2", COARSE)
    composed = unicodedata.normalize("NFC", DECOMPOSED)
    assert composed != DECOMPOSED
    ids = ours.encode(DECOMPOSED, add_bos=False)
    assert ids == hf.encode(DECOMPOSED, add_special_tokens=False).ids == ours.encode(composed, add_bos=False)
    assert ours.decode(ids) == composed
    # The other families keep the text as it is.
    _, llama = _from_gguf(tmp_path, "llama-bpe", COARSE)
    assert llama.decode(llama.encode(DECOMPOSED, add_bos=False)) == DECOMPOSED


def test_add_bos_defaults_follow_llama_cpp(tmp_path: Path):
    """Where tokenizer.ggml.add_bos_token is absent llama.cpp adds BOS for Llama 3's and tekken's
    pre-tokenizers only."""
    for pre, expected in [
        ("llama-bpe", True),
        ("tekken", True),
        ("qwen2", False),
        ("dbrx", False),
        ("gpt-2", False),
    ]:
        _, ours = _from_gguf(tmp_path, pre, add_bos=None)
        assert ours.add_bos is expected, pre
        assert (ours.encode("hi")[0] == ours.bos_id) is expected
        _, explicit = _from_gguf(tmp_path, pre, add_bos=not expected)
        assert explicit.add_bos is (not expected)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "default"])
def test_byte_level_bpe_save_then_from_hf_round_trips(pre: str, tmp_path: Path):
    """The saved tokenizer.json keeps the split, the normalizer and ignore_merges."""
    _, ours = _from_gguf(tmp_path, pre, COARSE, add_bos=None)
    ours.save(tmp_path / "saved")
    reloaded = Tokenizer.from_hf(tmp_path / "saved")
    assert (reloaded.add_bos, reloaded.bos_id, reloaded.eos_ids) == (ours.add_bos, ours.bos_id, ours.eos_ids)
    for text in [*BATTERY, DECOMPOSED]:
        assert reloaded.encode(text) == ours.encode(text), text


def test_unknown_pre_tokenizer_is_a_value_error(tmp_path: Path):
    path = tmp_path / "unknown.gguf"
    _write_byte_level_gguf(path, _vocabulary("gpt-2"), "no-such-pre", add_bos=False)
    with pytest.raises(ValueError, match="unsupported byte-level pre-tokenizer.*no-such-pre"):
        Tokenizer.from_gguf(path)


# ---- SentencePiece

SP_CONTROL = ["<start_of_turn>", "<end_of_turn>"]
SP_USER_DEFINED = ["▁▁", "▁▁▁▁", "<|tool|>"]  # Gemma-style whitespace runs, and a marker


def _train_sentencepiece(add_dummy_prefix: bool) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(line.rstrip("\n") for line in TRAINING_LINES if line.strip()),
        model_writer=model,
        model_type="bpe",
        vocab_size=700,
        byte_fallback=True,
        add_dummy_prefix=add_dummy_prefix,
        # Llama 2, Mistral, Phi-3 and Gemma normalize nothing and keep whitespace as it is.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=0.99,
        control_symbols=SP_CONTROL,
        user_defined_symbols=SP_USER_DEFINED,
        minloglevel=2,
    )
    return model.getvalue()


def _write_sentencepiece_gguf(
    path: Path, sp, add_space_prefix: bool | None, unk_id: bool = True, unk_type: int = TOKEN_UNKNOWN
) -> None:
    """The model as llama.cpp's converter writes it (convert_hf_to_gguf.py, _create_vocab_sentencepiece, with
    the added tokens of tokenizer_config.json: control ones CONTROL, the others USER_DEFINED with "▁" written
    as a space, both scored -1000)."""
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        token, score = sp.id_to_piece(i), sp.get_score(i)
        if sp.is_unknown(i):
            token_type = unk_type
        elif sp.is_control(i):
            token_type = TOKEN_CONTROL
        elif sp.is_unused(i):
            token_type = TOKEN_UNUSED
        elif sp.is_byte(i):
            token_type = TOKEN_BYTE
        else:
            token_type = TOKEN_NORMAL
        if token in SP_CONTROL:
            score = -1000.0
        elif token in SP_USER_DEFINED:
            token, token_type, score = token.replace("▁", " "), TOKEN_USER_DEFINED, -1000.0
        tokens.append(token)
        scores.append(score)
        types.append(token_type)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    if unk_id:
        writer.add_unk_token_id(sp.unk_id())
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


SP_BATTERY = [
    *BATTERY,
    " leading space",
    "  two leading spaces",
    "ends with a space ",
    "a\nb",
    "\nstarts with a newline",
    "tab\tand\u3000ideographic space",
    "unknown characters need bytes: ꙮ 𓀀 ☃ 🦩 ǅ",
    "     five spaces then x",
    "x<|tool|>y <|tool|> z",
]


def _expected_sentencepiece(sp, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization: control tokens split out of the text, and each fragment encoded
    on its own (so each gets the dummy prefix, when there is one)."""
    ids: list[int] = []
    rest = text
    while rest:
        hits = [(rest.find(c), c) for c in SP_CONTROL if c in rest]
        if not hits:
            return ids + sp.encode(rest)
        at, control = min(hits)
        if at:
            ids += sp.encode(rest[:at])
        ids.append(sp.piece_to_id(control))
        rest = rest[at + len(control) :]
    return ids


_SP_MODELS: dict[bool, bytes] = {}


def _sp(add_dummy_prefix: bool):
    if add_dummy_prefix not in _SP_MODELS:
        _SP_MODELS[add_dummy_prefix] = _train_sentencepiece(add_dummy_prefix)
    return sentencepiece.SentencePieceProcessor(model_proto=_SP_MODELS[add_dummy_prefix])


@pytest.mark.parametrize(
    "add_dummy_prefix, add_space_prefix",
    [(True, True), (True, None), (False, False)],
    ids=["dummy-prefix", "dummy-prefix-by-default", "no-dummy-prefix"],
)
def test_sentencepiece_matches_the_original(add_dummy_prefix: bool, add_space_prefix: bool | None, tmp_path):
    sp = _sp(add_dummy_prefix)
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path, sp, add_space_prefix)
    ours = Tokenizer.from_gguf(path)
    assert ours.add_bos and ours.bos_id == sp.bos_id() and ours.eos_ids[0] == sp.eos_id()
    fell_back = False
    for text in SP_BATTERY:
        ids = ours.encode(text, add_bos=False)
        assert ids == sp.encode(text), text
        assert ours.encode(text) == [sp.bos_id(), *ids]
        assert ours.decode(ids) == sp.decode(ids) == text
        fell_back |= any(sp.is_byte(i) for i in ids)
    assert fell_back
    # The dummy prefix: "▁" starts the first piece exactly when the model adds it.
    assert sp.id_to_piece(ours.encode("Hello", add_bos=False)[0]).startswith("▁") is add_dummy_prefix
    # Whitespace runs match the user-defined pieces greedily.
    pieces = [sp.id_to_piece(i) for i in ours.encode("x" + " " * 6 + "y", add_bos=False)]
    assert pieces[-3:] == ["▁▁▁▁", "▁▁", "y"]


@pytest.mark.parametrize("add_dummy_prefix", [True, False])
def test_sentencepiece_control_tokens_split_the_text(add_dummy_prefix: bool, tmp_path: Path):
    sp = _sp(add_dummy_prefix)
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path, sp, add_dummy_prefix)
    ours = Tokenizer.from_gguf(path)
    texts = [
        "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
        "text <end_of_turn> more text<start_of_turn>",
        "<start_of_turn><end_of_turn>",
    ]
    for text in texts:
        ids = ours.encode(text, add_bos=False)
        assert ids == _expected_sentencepiece(sp, text), text
        assert ours.decode(ids, skip_special=False) == text
    start = sp.piece_to_id("<start_of_turn>")
    assert ours.is_special(start) and ours.decode([start]) == ""


@pytest.mark.parametrize("unk_type", [TOKEN_UNKNOWN, TOKEN_CONTROL])
def test_sentencepiece_without_unknown_token_id(unk_type: int, tmp_path: Path):
    """Without tokenizer.ggml.unknown_token_id the unknown token is the UNKNOWN-typed one, else id 0
    (llama.cpp's SentencePiece default; gguf-py's LlamaHfVocab types "<unk>" CONTROL)."""
    sp = _sp(True)
    assert sp.unk_id() == 0
    path = tmp_path / "sp.gguf"
    _write_sentencepiece_gguf(path, sp, True, unk_id=False, unk_type=unk_type)
    ours = Tokenizer.from_gguf(path)
    for text in SP_BATTERY:
        assert ours.encode(text, add_bos=False) == sp.encode(text), text
