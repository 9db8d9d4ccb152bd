"""Chat templates: the Jinja2 programs that models ship to turn a list of messages into one prompt string.

Templates come from untrusted model files, so they run in Jinja2's immutable sandbox. The environment matches
what Hugging Face templates are written against: `trim_blocks` and `lstrip_blocks`, the `loopcontrols`
extension, a `tojson` filter, and the globals `raise_exception(message)` and `strftime_now(format)`.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox


class ChatTemplateError(ValueError):
    """The template rejected the messages (its own `raise_exception`) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template rejected the messages: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Templates embed tool schemas with this; keep non-ASCII text readable as the model saw it in training.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Checks that messages is a non-empty sequence of {"role": str, "content": str, ...} mappings."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a sequence of mappings, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a mapping, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{index}] needs a non-empty string 'role', got {role=}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}] needs a string 'content', got {type(content).__name__}")
        checked.append(dict(message))
    return checked


class ChatTemplate:
    """A compiled chat template; `render` is safe to call from several threads (Jinja templates are)."""

    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise ValueError("chat template source is empty")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template does not compile: {e}") from e
        self.source = source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        bos_token: str,
        eos_token: str,
        **extra: Any,
    ) -> str:
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos_token,
                eos_token=eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from e
