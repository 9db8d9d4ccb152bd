"""What a caller asks for: sampling parameters and stop conditions of one request (host side)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop settings.

    temperature == 0 means greedy. top_k == 0 and top_p == 1 and min_p == 0 disable those filters.
    repetition_penalty (Hugging Face semantics, > 1 discourages) and presence_penalty (OpenAI semantics,
    subtracted once) apply to every token already seen in the prompt or the output.
    The seed makes sampling reproducible: token i of a request depends only on (seed, i, logits).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def validate(self) -> None:
        """Raises ValueError with a message naming the bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not math.isfinite(self.presence_penalty):
            raise ValueError(f"presence_penalty must be finite, got {self.presence_penalty}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


def check_request(
    prompt_token_ids: Sequence[int], s: SamplingParams, *, vocab_size: int, max_seq_len: int
) -> None:
    """Raises ValueError saying what is wrong with a request before it reaches the device."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in s.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    s.validate()
    if len(prompt_token_ids) + s.max_tokens > max_seq_len:
        raise ValueError(
            f"prompt of {len(prompt_token_ids)} tokens + max_tokens={s.max_tokens} exceeds the context "
            f"length {max_seq_len}"
        )


def with_eos(s: SamplingParams, eos_ids: Sequence[int]) -> SamplingParams:
    """The device stops only on stop ids, so the model's end-of-sequence ids join the request's."""
    if s.ignore_eos:
        return s
    extra = tuple(t for t in eos_ids if t not in s.stop_token_ids)
    return dataclasses.replace(s, stop_token_ids=tuple(s.stop_token_ids) + extra)
