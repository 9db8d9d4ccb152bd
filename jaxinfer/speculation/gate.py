"""The adaptive switches of speculation: one per drafter and request, one per row bucket of a batch.

A request that speculates with the draft heads keeps one gate for prompt lookup and one for the heads:
the two fail on different text (lookup where the answer does not repeat its context, the heads where it
is hard to guess), and a pause of one must leave the other drafting. Over several requests, a batch
gate weighs what verification steps give the whole batch against what they cost it (step_costs.py).
Pure Python; the scheduler owns the gates.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.speculation.config import SpeculationConfig


@dataclasses.dataclass
class Pausing:
    """A switch that failure turns off for a while: paused: decode steps left before it tries again;
    next_pause: the length of the pause after the next failure (doubles while retries keep failing,
    up to 16 times config.pause_steps)."""

    paused: int = 0
    next_pause: int = 0

    @property
    def is_open(self) -> bool:
        return not self.paused

    def tick(self) -> None:
        """One decode step planned: a pause runs one step shorter."""
        if self.paused:
            self.paused -= 1

    def _pause(self, config: SpeculationConfig) -> None:
        self.paused = self.next_pause or config.pause_steps
        self.next_pause = min(2 * self.paused, 16 * config.pause_steps)


@dataclasses.dataclass
class DraftGate(Pausing):
    """average: accepted drafts per full-width step, an exponential average of the steps judged;
    steps: steps judged since drafting began or last resumed; drafted: drafts judged in all."""

    average: float = 0.0
    steps: int = 0
    drafted: int = 0

    def judge(self, config: SpeculationConfig, num_drafts: int, accepted: int) -> None:
        """Folds one step's outcome into the average: `num_drafts` verified (0: the heads ran and were
        sure of nothing, a step's cost for no tokens), `accepted` of them kept. Pauses the drafter when
        the average falls below config.min_accepted."""
        # Per full-width step: a narrower step costs less (JaxEngine verifies the narrowest width that
        # holds the drafts), so one draft accepted half the time pays as well as k accepted k / 2 times.
        per_step = accepted * config.num_draft_tokens / max(num_drafts, 1)
        self.steps += 1
        self.drafted += num_drafts
        self.average = 0.7 * self.average + 0.3 * per_step
        enough = self.drafted >= 4 * config.num_draft_tokens or self.steps >= 4 * config.num_draft_tokens
        if self.average < config.min_accepted and enough:
            # Paused, then tried again; a drafter that fails every time it tries waits twice as long
            # each time (every verification step costs every row of the batch the wider step).
            self._pause(config)
            self.average = config.min_accepted  # a fresh start when it resumes
            self.steps = 0
        elif per_step >= config.min_accepted:
            self.next_pause = 0


@dataclasses.dataclass
class BatchGate(Pausing):
    """Speculation for steps over several requests, in one row bucket of the engine.

    Each verification step is weighed by its tokens against what plain steps would have given in its
    time: its rows times its cost in plain steps (StepCosts.ratio). Each request's own gates judge its
    drafts alone; this one judges what its drafts cost the requests beside it, each of which runs the
    step's full width. Once `MIN_STEPS` steps are judged (half as many on a retry after a failure), the
    batch decodes plainly for a pause while the steps' tokens fall short of their cost, then tries
    again. The two are sums over the steps since speculation began or last resumed, each older step's
    share shrinking by DECAY: their ratio is the recent steps' throughput against plain decoding's,
    steadier than an average of each step's ratio (one step's tokens swing between one per row and
    the full width)."""

    MIN_STEPS = 8
    DECAY = 0.9

    tokens: float = 0.0
    cost: float = 0.0
    steps: int = 0

    def judge(self, config: SpeculationConfig, tokens: int, cost: float) -> None:
        """One verification step: `tokens` over its rows, `cost` the rows a plain step would have
        decoded in its time."""
        self.tokens = self.DECAY * self.tokens + tokens
        self.cost = self.DECAY * self.cost + cost
        self.steps += 1
        # A retry after a failure needs half the evidence: the batch has lost here before.
        if self.steps < (self.MIN_STEPS // 2 if self.next_pause else self.MIN_STEPS):
            return
        if self.tokens < self.cost:
            self._pause(config)
            self.tokens, self.cost, self.steps = 0.0, 0.0, 0
        else:
            self.next_pause = 0
