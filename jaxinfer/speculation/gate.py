"""The adaptive switch of one drafter for one request: drafts that keep failing pause that drafter.

A request that speculates with the draft heads keeps one gate for prompt lookup and one for the heads:
the two fail on different text (lookup where the answer does not repeat its context, the heads where it
is hard to guess), and a pause of one must leave the other drafting. Pure Python; the scheduler owns
the gates of its requests.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.speculation.config import SpeculationConfig


@dataclasses.dataclass
class DraftGate:
    """average: accepted drafts per full-width step, an exponential average of the steps judged;
    paused: decode steps left before the drafter tries again; next_pause: the length of the pause
    after the next failure (doubles while retries keep failing); steps: steps judged since drafting
    began or last resumed; drafted: drafts judged in all."""

    average: float = 0.0
    paused: int = 0
    next_pause: int = 0
    steps: int = 0
    drafted: int = 0

    @property
    def is_open(self) -> bool:
        return not self.paused

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
            self.paused = self.next_pause or config.pause_steps
            self.next_pause = min(2 * self.paused, 16 * config.pause_steps)
            self.average = config.min_accepted  # a fresh start when it resumes
            self.steps = 0
        elif per_step >= config.min_accepted:
            self.next_pause = 0

    def tick(self) -> None:
        """One decode step planned for the request: a pause runs one step shorter."""
        if self.paused:
            self.paused -= 1
