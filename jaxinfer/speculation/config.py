"""How a server speculates: the drafter, the drafts per step and the switches that turn it off."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence


class SpeculativeMethod(enum.StrEnum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup on the host (speculation.ngram)
    HEADS = "heads"  # draft heads on the device (speculation.draft_heads), prompt lookup where it matches


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """method: the server's default drafter (a request may pick another or turn it off).
    num_draft_tokens: drafts verified per step and request (the engine's verification width - 1). A
        server's default is default_num_draft_tokens(), measured on its backend.
    max_rows: speculate only while at most this many requests decode: past it a step is no longer
        bound by reading the weights, so verifying k + 1 positions per request costs about k + 1
        times a plain step and drafts stop paying. A server's default is default_max_rows(), the
        crossover measured on its backend. Below it, over several requests, the scheduler weighs each
        verification step against its cost measured at warm-up (speculation.gate.BatchGate).
    min_accepted: a drafter (prompt lookup, or a request's heads) whose recent verification steps
        accept fewer drafts per step than this (an exponential average; a step of d < k drafts counts
        its accepted drafts times k / d, as a narrower verification costs less) stops drafting for that
        request for `pause_steps` decode steps, then tries again (each failed retry doubles the pause,
        up to 16x): a step that verifies drafts costs more than a plain one, for every request in it,
        so drafts that keep failing slow the batch down. A step whose draft heads ran for the request
        and were sure of nothing counts as a step that accepted none: the heads cost the step their
        time. Each drafter pauses apart (speculation.gate). A server's default is
        default_min_accepted(), measured on its backend.
    ngram_max, ngram_min: the n-gram sizes prompt lookup matches, longest first; a match of n tokens
        drafts at most n + 1 of the num_draft_tokens (NgramIndex.propose).
    draft_min_probability: draft heads draft while their guess is at least this likely under them
        (draft_heads.propose), one threshold per depth (the last for every deeper draft): on CPU a
        verified position costs more the more positions a step verifies (a first draft ~8% of a step,
        a second ~20%), so a first draft pays at lower odds than a deeper one. AUTO: the engine's
        warm-up chooses them per row bucket, pricing the heads' held-out drafts at the step costs it
        measures (speculation.thresholds; DEFAULT_DRAFT_MIN_PROBABILITY where the heads came without
        held-out drafts). Not the default: on a Zen 5 EPYC the chosen ones ran chat 1.54-1.58x against
        0.15 / 0.4 / 0.7's 1.61-1.63x (docs/benchmarks.md); warm-up's step costs there move 20-40%
        between runs.
    """

    method: SpeculativeMethod = SpeculativeMethod.OFF
    num_draft_tokens: int = 4
    max_rows: int = 4
    min_accepted: float = 0.5
    pause_steps: int = 16
    ngram_max: int = 4
    ngram_min: int = 2
    draft_min_probability: tuple[float, ...] | str = (0.05, 0.2, 0.5)

    def __post_init__(self):
        object.__setattr__(self, "method", SpeculativeMethod(self.method))
        object.__setattr__(self, "draft_min_probability", draft_thresholds(self.draft_min_probability))
        if self.num_draft_tokens < 1 or self.max_rows < 1 or self.pause_steps < 0:
            raise ValueError(
                f"{self.num_draft_tokens=}, {self.max_rows=} must be >= 1, {self.pause_steps=} >= 0"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min={self.ngram_min} <= ngram_max={self.ngram_max}")


# Heads distilled on the target's distribution (training.py) are less sure than their hit rate, so
# these sit below the odds a draft needs. Against the surer 0.15 / 0.4 / 0.7 (docs/benchmarks.md),
# chat with the heads: a Zen 4 EPYC, one stream 1.53-1.55x against 1.49-1.51x, two 1.21x against
# 1.14x, four 1.03x against 1.01x (alternated in one process); an Intel Xeon, whose first drafts cost
# less, one stream 1.51-1.53x against 1.37-1.44x; a Zen 5 EPYC about 1.54x against 1.61-1.63x (from
# separate runs).
DEFAULT_DRAFT_MIN_PROBABILITY = SpeculationConfig.draft_min_probability
AUTO = "auto"  # draft thresholds chosen at warm-up (SpeculationConfig.draft_min_probability)

ACCELERATOR = "accelerator"
# CPUs where even one row keeps the multipliers busy (the native kernels' AVX2 code, or XLA's), so each
# position a step verifies adds about its own multiply time.
EACH_POSITION_MULTIPLIES = ("avx2", None)


def default_max_rows() -> int:
    """Up to how many decoding requests verifying drafts pays on this backend, as measured with
    `scripts/bench_speculative.py --crossover` (docs/benchmarks.md). On CPU it is the native kernels'
    multiply throughput that decides: with AVX-512 VNNI a 5-position verification step of SmolLM2 stays
    near a plain step's cost up to four requests (the code edit: 1.55x at four, 0.78x at eight); with
    AVX2 alone, one row already keeps the multipliers busy, so a step's cost grows with every verified
    position (the code edit: 1.09x at one request, 0.88x at two); a CPU without the native kernels is
    slower per row still. With AVX-VNNI's 256-bit dot products (an AVX2 core, XLA's own code AVX2) a
    5-position step still pays at one request but not past it (the code edit: 1.60x at one, 1.05x at
    two, 0.81x at four). Accelerators keep the larger value until one is measured."""
    one_row = (*EACH_POSITION_MULTIPLIES, "avx_vnni")
    return 1 if _kernel_isa() in one_row else SpeculationConfig.max_rows


def default_num_draft_tokens() -> int:
    """The drafts a request verifies per step by default on this backend (docs/benchmarks.md). Where
    every verified position costs its own multiplies (AVX2 alone: about half a plain step each), four
    drafts pay only when nearly all are accepted: SmolLM2 with prompt lookup at one stream on an AVX2-only
    EPYC, 16 chat prompts, geometric mean 0.92-0.94x with four drafts against 1.01-1.02x with two (the
    code edit 0.93-0.96x / 1.02-1.03x). Elsewhere 4."""
    return 2 if _kernel_isa() in EACH_POSITION_MULTIPLIES else SpeculationConfig.num_draft_tokens


def default_min_accepted() -> float:
    """The drafts per step below which a request's drafter pauses, by default on this backend
    (docs/benchmarks.md). With AVX-512 VNNI a verification step of a few positions reads the weights
    about as fast as a plain step, so drafts pay at a low acceptance and pausing them loses more than
    it saves: SmolLM2 with its draft heads at one stream on a Zen 4 EPYC, 16 chat prompts, geometric
    mean 1.45x at 0.2 against 1.40x at 0.5 (prompt lookup alone: 1.30x either way). Where each verified
    position costs its own multiplies, 0.5."""
    return SpeculationConfig.min_accepted if _kernel_isa() in EACH_POSITION_MULTIPLIES else 0.2


def server_config(method: SpeculativeMethod | str, **fields) -> SpeculationConfig:
    """A server's speculation config: the `fields` given (those not None) as they are, and
    num_draft_tokens, max_rows and min_accepted otherwise as measured on this backend (the default_*()
    functions above)."""
    measured = dict(
        num_draft_tokens=default_num_draft_tokens(),
        max_rows=default_max_rows(),
        min_accepted=default_min_accepted(),
    )
    given = {name: value for name, value in fields.items() if value is not None}
    return SpeculationConfig(method=method, **{**measured, **given})


def _kernel_isa() -> str | None:
    """The name of the ISA the native CPU kernels run on this backend: None on a CPU where XLA serves,
    ACCELERATOR off the CPU."""
    import jax

    from jaxinfer.cpu_kernels.native_build import best_isa

    if jax.default_backend() != "cpu":
        return ACCELERATOR
    isa = best_isa()
    return isa.name if isa else None


def min_probabilities(value: float | str | Sequence[float]) -> tuple[float, ...]:
    """Per-depth draft thresholds from a number, a sequence or a comma-separated string ("0.25,0.65"),
    each in [0, 1); ValueError otherwise."""
    if isinstance(value, str):
        value = [float(part) for part in value.split(",")]
    values = (float(value),) if isinstance(value, int | float) else tuple(float(v) for v in value)
    if not values or not all(0.0 <= v < 1.0 for v in values):
        raise ValueError(f"draft_min_probability={value} must be one or more values in [0, 1)")
    return values


def draft_thresholds(value: float | str | Sequence[float]) -> tuple[float, ...] | str:
    """AUTO for "auto", else min_probabilities(value)."""
    return AUTO if value == AUTO else min_probabilities(value)


def depth_threshold(thresholds: Sequence[float], depth: int) -> float:
    """The threshold of the draft at `depth` (0-based): the last one for drafts past the list."""
    return thresholds[min(depth, len(thresholds) - 1)]
