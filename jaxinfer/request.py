"""One request path: what a caller asks for, parsed and validated here once for every front end.

gRPC (service.py), HTTP (openai_api.py), `jaxinfer batch` (batch.py) and the CLI only rename their
protocol's fields to the names below; this module turns them into a prompt's token ids and a
SamplingParams, checks each field once (one message per mistake, naming the field), and defines how a
request ends (FinishReason).

Fields (`parse_sampling`): max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty,
presence_penalty, frequency_penalty, stop, stop_token_ids, ignore_eos, logprobs, structured_output,
speculative, num_draft_tokens.
A field left out takes the model's recommended value (`ModelDefaults`), else SamplingParams' own; an
unset seed draws a fresh random one, so two unseeded requests sample independently.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

MAX_TOP_LOGPROBS = 20  # alternatives per position the device returns (OpenAI's limit)
SPECULATIVE_METHODS = ("off", "ngram", "heads")  # speculation.config.SpeculativeMethod's values
MAX_DRAFT_TOKENS = 7  # kernel_dispatch.MAX_QUERIES_AS_ROWS - 1
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class FinishReason(enum.StrEnum):
    STOP = "stop"  # a stop token, stop string, or the end of a structured output
    LENGTH = "length"  # max_tokens or the context's end
    CANCELLED = "cancelled"  # the client went away or the server stopped
    ERROR = "error"  # the server failed


class RequestError(ValueError):
    """A bad request; `param` names the field (gRPC INVALID_ARGUMENT, HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class NoChatTemplate(RequestError):
    """Chat messages for a model without a chat template (gRPC FAILED_PRECONDITION, HTTP 400)."""


class StructuredKind(enum.StrEnum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON that validates against `spec` (a JSON Schema, as JSON text)
    REGEX = "regex"
    LARK = "lark"  # a context-free grammar in Lark syntax (llguidance's dialect)


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output text, enforced by a token mask at every step (structured_output.py)."""

    kind: StructuredKind
    spec: str = ""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop settings.

    temperature == 0 means greedy. top_k == 0 and top_p == 1 and min_p == 0 disable those filters.
    repetition_penalty (Hugging Face semantics, > 1 discourages), presence_penalty (OpenAI semantics,
    subtracted once) and frequency_penalty (subtracted once per occurrence) apply to every token already
    seen in the prompt or the output.
    The seed makes sampling reproducible: token i of a request depends only on (seed, i, logits).
    logprobs: None returns none; k >= 0 returns the chosen token's log-probability and the k most likely
    alternatives', from the model's distribution before penalties, temperature and filters.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # Speculative decoding: "off", "ngram" or "heads"; None takes the server's. num_draft_tokens: drafts
    # per step, at most the server's (None: the server's).
    speculative: str | None = None
    num_draft_tokens: int | None = None

    def errors(self) -> list[RequestError]:
        """Every value out of range, one error each."""
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            (
                "repetition_penalty",
                math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
                "must be > 0",
            ),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens > 0, "must be > 0"),
            ("seed", 0 <= self.seed < 2**63, "must be in [0, 2**63)"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"must be in [0, {MAX_TOP_LOGPROBS}]",
            ),
            (
                "speculative",
                self.speculative in (None, *SPECULATIVE_METHODS),
                f"must be one of {SPECULATIVE_METHODS}",
            ),
            (
                "num_draft_tokens",
                self.num_draft_tokens is None or 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS,
                f"must be in [0, {MAX_DRAFT_TOKENS}]",
            ),
        ]
        found = [
            RequestError(f"{name}={getattr(self, name)!r} {rule}", name)
            for name, ok, rule in checks
            if not ok
        ]
        if any(not s for s in self.stop):
            found.append(RequestError("stop strings must be non-empty", "stop"))
        return found

    def validate(self) -> None:
        """Raises RequestError naming every bad field."""
        _raise(self.errors())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SamplingParams:
        d = dict(d)
        d["stop_token_ids"], d["stop"] = tuple(d["stop_token_ids"]), tuple(d["stop"])
        if d.get("structured_output") is not None:
            d["structured_output"] = StructuredOutput(**d["structured_output"])
        return cls(**d)


def _raise(errors: Sequence[RequestError]) -> None:
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise RequestError("; ".join(str(e) for e in errors), errors[0].param)


# ---- model defaults --------------------------------------------------------------------------------

DEFAULTABLE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclasses.dataclass(frozen=True)
class ModelDefaults:
    """The model's recommended sampling values for fields a request leaves unset, and where they came
    from (a Hugging Face generation_config.json, the GGUF file's general.sampling.* keys, or the
    model's published recommendation for an embedded model)."""

    values: Mapping[str, float | int] = dataclasses.field(default_factory=dict)
    source: str = "none"

    def __post_init__(self):
        unknown = set(self.values) - set(DEFAULTABLE_FIELDS)
        if unknown:
            raise ValueError(f"unknown sampling defaults {sorted(unknown)}; expected {DEFAULTABLE_FIELDS}")

    def to_json(self) -> dict:
        return {"values": dict(self.values), "source": self.source}

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any], source: str) -> ModelDefaults:
        """Reads a Hugging Face generation_config.json; do_sample false means greedy."""
        values = {k: config[k] for k in DEFAULTABLE_FIELDS if config.get(k) is not None}
        if config.get("do_sample") is False:
            values = {"temperature": 0.0}
        return cls(values, source)


# ---- fields -> SamplingParams ------------------------------------------------------------------------

_NUMBER = (int, float)
# Field name -> the JSON types it accepts.
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "seed": (int,),
    "repetition_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER,
    "ignore_eos": (bool,),
    "logprobs": (int,),
    "stop": (str, list, tuple),
    "stop_token_ids": (list, tuple),
    "structured_output": (StructuredOutput,),
    "speculative": (str,),
    "num_draft_tokens": (int,),
}


def _type_error(name: str, value: Any, types: tuple[type, ...]) -> RequestError | None:
    # bool is an int in Python; a JSON true is not a number here.
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        names = "/".join(
            "number" if t is float else t.__name__ for t in types if t is not int or float not in types
        )
        return RequestError(f"{name}={value!r:.60} must be of type {names}", name)
    return None


def parse_sampling(fields: Mapping[str, Any], *, defaults: ModelDefaults | None = None) -> SamplingParams:
    """Protocol fields (see the module docstring) -> a SamplingParams.

    `fields` holds only what the request set (None counts as unset). Unset fields come from the
    model's `defaults`, then SamplingParams(). Raises RequestError naming every field of the wrong
    type; the values are checked with the request's prompt by check_request.
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    errors = []
    unknown = set(fields) - set(FIELD_TYPES)
    if unknown:
        errors.append(RequestError(f"unknown sampling fields {sorted(unknown)}", sorted(unknown)[0]))
    for name in set(fields) & set(FIELD_TYPES):
        if (e := _type_error(name, fields[name], FIELD_TYPES[name])) is not None:
            errors.append(e)
    _raise(errors)
    values = dict(fields)
    if "stop" in values:
        stop = values["stop"]
        stop = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) for s in stop):
            errors.append(
                RequestError(f"stop={values['stop']!r:.60} must be a string or a list of strings", "stop")
            )
        values["stop"] = tuple(stop)
    if "stop_token_ids" in values:
        ids = list(values["stop_token_ids"])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            errors.append(RequestError("stop_token_ids must be a list of integers", "stop_token_ids"))
        values["stop_token_ids"] = tuple(ids)
    for name in values:
        if FIELD_TYPES[name] == _NUMBER:  # a JSON 1 is the float 1.0
            values[name] = float(values[name])
    _raise(errors)
    if "seed" not in values:
        values["seed"] = secrets.randbits(63)
    return SamplingParams(**{**dict((defaults or ModelDefaults()).values), **values})


def structured_output_from_json_schema(schema: Any, param: str) -> StructuredOutput:
    if not isinstance(schema, dict | bool):
        raise RequestError(f"{param} must be a JSON Schema object", param)
    return StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema))


# ---- prompts -----------------------------------------------------------------------------------------


def message_text(content: Any, param: str) -> str:
    """A chat message's content: a string, or a list of {"type": "text", "text": ...} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise RequestError(f"{param}[{j}] must be a text part {{'type': 'text', 'text': ...}}", param)
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"{param} must be a string or a list of text parts", param)


def encode_prompt(
    tokenizer,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    add_bos: bool | None = None,
    messages_name: str = "messages",
) -> list[int]:
    """Exactly one of a text prompt, token ids or chat messages ({role, content}) -> token ids.

    messages_name: what the caller's protocol calls the messages (gRPC: "chat"), for error messages.
    """
    candidates = [("prompt", prompt), ("prompt_token_ids", prompt_token_ids), (messages_name, messages)]
    given = [name for name, v in candidates if v]
    if len(given) != 1:
        raise RequestError(
            f"exactly one of prompt, prompt_token_ids and {messages_name} must be set and non-empty, got "
            + (", ".join(given) if given else "none (the prompt is empty)"),
            given[1] if len(given) > 1 else "prompt",
        )
    if prompt_token_ids:
        ids = list(prompt_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("prompt_token_ids must be integers", "prompt_token_ids")
        check_token_ids(ids, tokenizer.vocab_size, "prompt_token_ids")
        return ids
    if messages:
        chat, name = [], messages_name
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping):
                raise RequestError(f"{name}[{i}] must be an object with role and content", name)
            role = m.get("role")
            if role not in CHAT_ROLES:
                raise RequestError(f"{name}[{i}].role={role!r} is not one of {CHAT_ROLES}", name)
            role = "system" if role == "developer" else role
            chat.append({"role": role, "content": message_text(m.get("content"), f"{name}[{i}].content")})
        if not tokenizer.has_chat_template:
            raise NoChatTemplate("this model has no chat template; send a plain prompt", name)
        return tokenizer.encode_chat(chat)
    if not isinstance(prompt, str):
        raise RequestError(f"prompt={prompt!r:.60} must be a string", "prompt")
    try:
        return tokenizer.encode(prompt, add_bos=add_bos)
    except ValueError as e:
        raise RequestError(str(e), "prompt") from None


def check_token_ids(ids: Sequence[int], vocab_size: int, name: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"{name} {bad[:5]} are outside the vocabulary [0, {vocab_size})", name)


def check_request(
    prompt_token_ids: Sequence[int], s: SamplingParams, *, vocab_size: int, max_seq_len: int
) -> None:
    """Raises RequestError naming every bad value, then what the vocabulary and the context length
    rule out. Every way into the engine passes here once (Orchestrator.submit, generate)."""
    s.validate()
    if not prompt_token_ids:
        raise RequestError("the prompt is empty", "prompt")
    check_token_ids(prompt_token_ids, vocab_size, "prompt_token_ids")
    check_token_ids(s.stop_token_ids, vocab_size, "stop_token_ids")
    if len(prompt_token_ids) + s.max_tokens > max_seq_len:
        raise RequestError(
            f"prompt of {len(prompt_token_ids)} tokens + max_tokens={s.max_tokens} exceeds the context "
            f"length {max_seq_len}",
            "max_tokens",
        )


def with_eos(s: SamplingParams, eos_ids: Sequence[int]) -> SamplingParams:
    """The device stops only on stop ids, so the model's end-of-sequence ids join the request's."""
    if s.ignore_eos:
        return s
    extra = tuple(t for t in eos_ids if t not in s.stop_token_ids)
    return dataclasses.replace(s, stop_token_ids=tuple(s.stop_token_ids) + extra)
