"""How a server speculates: the drafter, the drafts per step and the switches that turn it off."""

from __future__ import annotations

import dataclasses
import enum


class SpeculativeMethod(enum.StrEnum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup on the host (speculation.ngram)
    HEADS = "heads"  # draft heads on the device (speculation.draft_heads), prompt lookup where it matches


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """method: the server's default drafter (a request may pick another or turn it off).
    num_draft_tokens: drafts verified per step and request (the engine's verification width - 1).
    max_rows: speculate only while at most this many requests decode: past it a step is no longer
        bound by reading the weights, so verifying k + 1 positions per request costs about k + 1
        times a plain step and drafts stop paying (measured per backend: docs/benchmarks.md).
    min_accepted: a request whose recent verification steps accept fewer drafts per step than this
        (an exponential average; a step of d < k drafts counts its accepted drafts times k / d, as a
        narrower verification costs less) stops drafting for `pause_steps` decode steps, then tries
        again (each failed retry doubles the pause, up to 16x): a step that verifies drafts costs more
        than a plain one, for every request in it, so drafts that keep failing slow the batch down.
        A step whose draft heads ran for the request and were sure of nothing counts as a step that
        accepted none: the heads cost the step their time.
    ngram_max, ngram_min: the n-gram sizes prompt lookup matches, longest first.
    draft_min_probability: draft heads draft while their guess is at least this likely under them
        (draft_heads.propose): on CPU a verified position costs a sixth to a third of a step, so a
        draft the target takes less than about half the time does not pay (docs/benchmarks.md).
    """

    method: SpeculativeMethod = SpeculativeMethod.OFF
    num_draft_tokens: int = 4
    max_rows: int = 4
    min_accepted: float = 0.5
    pause_steps: int = 16
    ngram_max: int = 4
    ngram_min: int = 2
    draft_min_probability: float = 0.5

    def __post_init__(self):
        object.__setattr__(self, "method", SpeculativeMethod(self.method))
        if self.num_draft_tokens < 1 or self.max_rows < 1 or self.pause_steps < 0:
            raise ValueError(
                f"{self.num_draft_tokens=}, {self.max_rows=} must be >= 1, {self.pause_steps=} >= 0"
            )
        if not 0.0 <= self.draft_min_probability < 1.0:
            raise ValueError(f"draft_min_probability={self.draft_min_probability} must be in [0, 1)")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min={self.ngram_min} <= ngram_max={self.ngram_max}")
