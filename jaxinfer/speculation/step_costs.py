"""What a verification step costs against a plain decode step on this engine, measured at warm-up.

A step that verifies drafts pays for every row of its batch: each runs the step's width of positions,
whether or not its own drafts were any good. How much more than a plain step that costs depends on the
backend, the model and the row count (a CPU's multipliers stay idle at one row and fill up with
several), so the engine measures it once its programs are compiled (JaxEngine.warmup) and the scheduler
weighs each verification step's tokens against it (speculation.gate.BatchGate). Warm-up steps list no
row (they must change nothing), so what runs only for listed rows is left out: attention's reads of
the cache, and the draft heads, which are timed apart (`head`). The ratios understate a real step's
cost a little, and the gate errs towards speculating.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """plain: seconds of a plain decode step by row bucket, as the serving loop runs them (each goes
        out before the last one's tokens are read);
    verify: seconds of a verification step by (row bucket, width bucket), its tokens read before the
        next goes out (the drafts of the next step follow from them). Width 0 is a step in which the
        draft heads propose but nothing is verified.
    head: seconds one depth of the draft heads adds to a step, by row bucket (the heads' full depth
        timed apart, divided by it; measured only where warm-up chooses the draft thresholds): warm-up
        steps list no row, so the heads never run in them.
    Row buckets cover slot indices, as the engine's programs do: a step over slots 0 and 5 runs in the
    bucket of 8 rows."""

    plain: Mapping[int, float]
    verify: Mapping[tuple[int, int], float]
    head: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if {rows for rows, _ in self.verify} != set(self.plain):
            raise ValueError(f"verification and plain steps measured over different rows: {self}")
        if any(seconds <= 0 for seconds in (*self.plain.values(), *self.verify.values())):
            raise ValueError("step costs must be positive")

    def rows(self, slots: int) -> int | None:
        """The measured row bucket a step over the first `slots` slots runs in; None where none holds
        them (a warm-up for one job measures the buckets that job needs)."""
        return min((r for r in self.plain if r >= slots), default=None)

    def ratio(self, slots: int, width: int) -> float | None:
        """The cost of a step over the first `slots` slots verifying up to `width` drafts per row, in
        plain steps over the same slots: the smallest measured row and width buckets holding them;
        None where none does."""
        rows = self.rows(slots)
        widths = [w for r, w in self.verify if r == rows and w >= width]
        return self.verify[rows, min(widths)] / self.plain[rows] if widths else None

    def head_ratio(self, slots: int) -> float | None:
        """One depth of the heads over the first `slots` slots, in plain steps over them; None where
        unmeasured."""
        rows = self.rows(slots)
        return self.head[rows] / self.plain[rows] if rows in self.head else None

    def summary(self) -> str:
        """One line: each row bucket's plain step in ms and its verification steps in plain steps."""
        parts = []
        for rows in sorted(self.plain):
            widths = " ".join(f"{w}:{self.ratio(rows, w):.2f}" for r, w in sorted(self.verify) if r == rows)
            head = f", a head {self.head_ratio(rows):.3f}" if rows in self.head else ""
            parts.append(f"{rows} rows {1e3 * self.plain[rows]:.1f} ms, drafts {widths}{head}")
        return "; ".join(parts)
