"""request.py: fields -> SamplingParams (types, one message per mistake, model defaults), prompts, and
where a model's recommended sampling values come from."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from jaxinfer.loading.sampling_defaults import sampling_defaults
from jaxinfer.request import (
    FinishReason,
    ModelDefaults,
    NoChatTemplate,
    RequestError,
    SamplingParams,
    check_request,
    encode_prompt,
    parse_sampling,
)
from jaxinfer.testing import FakeTokenizer

TOK = FakeTokenizer()


def test_fields_override_model_defaults_which_override_the_engine_defaults():
    defaults = ModelDefaults({"temperature": 0.2, "top_p": 0.9}, "card")
    s = parse_sampling({"top_p": 0.5, "max_tokens": 7, "stop": "x", "seed": 3}, defaults=defaults)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.stop, s.seed) == (0.2, 0.5, 0, 7, ("x",), 3)
    assert parse_sampling({"temperature": None}, defaults=defaults).temperature == 0.2  # None is unset


def test_unset_seed_is_random_and_a_set_one_is_kept():
    seeds = {parse_sampling({}).seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert parse_sampling({"seed": 0}).seed == 0


def test_every_type_mistake_is_named_at_once():
    with pytest.raises(RequestError) as e:
        parse_sampling({"temperature": "hot", "top_k": 1.5, "ignore_eos": 1, "colour": "red"})
    message = str(e.value)
    for fragment in ("temperature='hot'", "top_k=1.5", "ignore_eos=1", "colour"):
        assert fragment in message
    with pytest.raises(RequestError, match="stop") as e:
        parse_sampling({"stop": ["a", 3]})
    assert e.value.param == "stop"
    with pytest.raises(RequestError, match="max_tokens") as e:
        parse_sampling({"max_tokens": True})  # a JSON true is not a number


def test_values_are_checked_with_the_prompt_once():
    s = parse_sampling({"temperature": -1, "top_p": 0, "max_tokens": 4})
    with pytest.raises(RequestError) as e:
        check_request([5], s, vocab_size=10, max_seq_len=16)
    assert "temperature=-1.0" in str(e.value) and "top_p=0.0" in str(e.value)
    with pytest.raises(RequestError, match="context length 16") as e:
        check_request([5] * 14, SamplingParams(max_tokens=4), vocab_size=10, max_seq_len=16)
    assert e.value.param == "max_tokens"


def test_prompts_messages_and_token_ids():
    assert encode_prompt(TOK, prompt="hello") == TOK.encode("hello")
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}
    ]
    assert encode_prompt(TOK, messages=messages) == TOK.encode_chat([{"role": "user", "content": "hello"}])
    with pytest.raises(RequestError, match="exactly one of prompt, prompt_token_ids and chat"):
        encode_prompt(TOK, prompt="a", messages=messages, messages_name="chat")
    with pytest.raises(RequestError, match=r"messages\[0\].role='wizard'"):
        encode_prompt(TOK, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(RequestError, match="outside the vocabulary") as e:
        encode_prompt(TOK, prompt_token_ids=[1, 10**6])
    assert e.value.param == "prompt_token_ids"
    with pytest.raises(NoChatTemplate):
        encode_prompt(FakeTokenizer(has_chat_template=False), messages=[{"role": "user", "content": "x"}])


def test_sampling_params_survive_json_and_finish_reasons_are_their_strings():
    from jaxinfer.request import StructuredKind, StructuredOutput

    s = SamplingParams(stop=("a",), stop_token_ids=(3,), logprobs=2,
                       structured_output=StructuredOutput(StructuredKind.REGEX, "[ab]+"))  # fmt: skip
    assert SamplingParams.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert FinishReason.STOP == "stop" and json.dumps(FinishReason.LENGTH) == '"length"'


def test_model_defaults_from_generation_config_gguf_and_the_registry(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    d = sampling_defaults(str(tmp_path), "hf", tmp_path)
    assert d.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sampling_defaults(str(tmp_path), "hf", tmp_path).values == {"temperature": 0.0}

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.7)
    writer.add_int32("general.sampling.top_k", 40)
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert sampling_defaults(str(path), "gguf", path).values == pytest.approx(
        {"temperature": 0.7, "top_k": 40}
    )

    smollm = sampling_defaults("smollm2-135m-instruct", "gguf", path)
    assert smollm.values == {"temperature": 0.2, "top_p": 0.9} and "model card" in smollm.source
