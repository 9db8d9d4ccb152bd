"""Draft thresholds chosen for this machine: the heads' held-out drafts priced at its step costs.

A draft pays when the tokens it adds are worth more than what verifying it adds to the step, and both
sides differ between machines: how sure the heads must be depends on how much a verified position
costs here (on an AVX-512 CPU a first draft at one row costs 0.03-0.15 of a plain step, a fourth
0.2-0.36; docs/benchmarks.md). Training keeps a sample of the heads' held-out drafts (`HeldOutDrafts`:
each depth's probability under its head, and how many drafts in a row greedy verification accepts);
warm-up measures what a step of each width and one depth of the heads cost at each row bucket
(step_costs.StepCosts);
`best_thresholds` picks, per row bucket, the per-depth thresholds under which those drafts would have
produced the most tokens per unit of cost. A step verifies its longest row of drafts and every row
pays for that width, so with more rows each draft must be surer.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxinfer.speculation.config import depth_threshold

HELD_OUT_FILE = "held_out_drafts.npz"
# Candidate thresholds per depth: finer where the heads are unsure, where most of their drafts lie.
GRID = (0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclasses.dataclass(frozen=True)
class HeldOutDrafts:
    """The heads' drafts at held-out positions, teacher-forced (speculation.training).

    probability: [n, depth] float32, the probability of each depth's draft under its head.
    accepted: [n] int32, how many drafts from the first greedy verification accepts (where the
        text leaves the greedy path, the chain ends there).
    """

    probability: np.ndarray
    accepted: np.ndarray

    def __post_init__(self):
        p, a = np.asarray(self.probability, np.float32), np.asarray(self.accepted, np.int32)
        if p.ndim != 2 or a.shape != p.shape[:1] or np.any(a < 0) or np.any(a > p.shape[1]):
            raise ValueError(f"probability {p.shape} and accepted {a.shape} do not describe drafts")
        object.__setattr__(self, "probability", p)
        object.__setattr__(self, "accepted", a)

    @property
    def depth(self) -> int:
        return self.probability.shape[1]

    def save(self, directory: str | Path) -> None:
        np.savez_compressed(
            Path(directory) / HELD_OUT_FILE,
            probability=self.probability.astype(np.float16),
            accepted=self.accepted.astype(np.int8),
        )

    @classmethod
    def load(cls, directory: str | Path) -> HeldOutDrafts | None:
        """The drafts saved in `directory`, None where there are none (heads trained without them)."""
        path = Path(directory) / HELD_OUT_FILE
        if not path.is_file():
            return None
        with np.load(path) as data:
            return cls(data["probability"], data["accepted"])


def num_drafts(drafts: HeldOutDrafts, thresholds: Sequence[float]) -> np.ndarray:
    """[n]: the drafts each position would verify, up to the first one below its depth's threshold
    (the last threshold for every deeper depth, as draft_heads.propose cuts them)."""
    t = [depth_threshold(thresholds, i) for i in range(drafts.depth)]
    sure = drafts.probability >= np.asarray(t, np.float32)[None]
    return np.sum(np.cumprod(sure, axis=1), axis=1)


def modeled_speed(
    drafts: HeldOutDrafts,
    thresholds: Sequence[float],
    costs: Sequence[float],
    rows: int = 1,
    head_cost: float = 0.0,
) -> float:
    """Tokens per row and plain step's cost at these thresholds: steps of `rows` held-out positions
    (drawn at random), each verifying its longest row of drafts and giving each row 1 + its accepted
    drafts (step_cost: what such a step costs)."""
    probability, accepted = _steps(drafts, rows)
    n = num_drafts(HeldOutDrafts(probability, accepted), thresholds)
    tokens = np.sum(1 + np.minimum(accepted, n))
    width = np.max(n.reshape(-1, rows), axis=1)
    return float(tokens / (rows * np.sum(step_cost(costs, head_cost, drafts.depth)[width])))


def step_cost(costs: Sequence[float], head_cost: float, depth: int) -> np.ndarray:
    """[depth + 1]: what a step verifying d drafts costs in plain steps, its heads included.

    costs[d]: the verification step alone (step_costs.StepCosts.ratio), made non-decreasing in d (a
    step verifying more positions does not cost less; a noisy measurement can say it does); head_cost:
    one depth of the heads, which run one depth past the longest row's drafts, up to their depth."""
    verify = np.maximum.accumulate(np.asarray(costs, np.float64))
    return verify + head_cost * np.minimum(np.arange(len(costs)) + 1, depth)


def best_thresholds(
    drafts: HeldOutDrafts,
    costs: Sequence[float],
    rows: int = 1,
    head_cost: float = 0.0,
    grid: Sequence[float] = GRID,
) -> tuple[tuple[float, ...], float]:
    """The per-depth thresholds from `grid` with the highest modeled_speed, and that speed.

    costs[d]: a step of `rows` rows verifying d drafts (0 .. depth) in plain steps of as many rows;
    head_cost: one depth of the heads in the same unit (step_cost). Every combination is priced at
    once from per-depth tables: a 3-deep grid of 13 over 16,384 drafts takes ~0.3 s."""
    if len(costs) != drafts.depth + 1:
        raise ValueError(f"{len(costs)} step costs for heads {drafts.depth} deep (need one per 0..depth)")
    probability, accepted = _steps(drafts, rows)
    g = np.asarray(grid, np.float32)
    cost = step_cost(costs, head_cost, drafts.depth)
    sure = probability[:, :, None] >= g[None, None]  # [n, depth, grid]
    best, best_speed = None, -1.0
    # The last depth vectorised over the grid, the shallower ones enumerated.
    for head in itertools.product(range(len(g)), repeat=drafts.depth - 1):
        alive = np.ones(len(accepted), bool)
        count = np.zeros(len(accepted), np.int64)
        for depth, choice in enumerate(head):
            alive &= sure[:, depth, choice]
            count += alive
        n = count[:, None] + (alive[:, None] & sure[:, -1])  # [n, grid]
        tokens = np.sum(1 + np.minimum(accepted[:, None], n), axis=0)
        width = np.max(n.reshape(-1, rows, len(g)), axis=1)  # [steps, grid]
        speed = tokens / (rows * np.sum(cost[width], axis=0))
        i = int(np.argmax(speed))
        if speed[i] > best_speed:
            best, best_speed = (*head, i), float(speed[i])
    return tuple(float(grid[i]) for i in best), best_speed


def _steps(drafts: HeldOutDrafts, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The drafts in a fixed random order, cut to whole steps of `rows`: consecutive groups of `rows`
    are the rows of one step."""
    steps = len(drafts.accepted) // rows
    if rows < 1 or steps == 0:
        raise ValueError(f"{len(drafts.accepted)} held-out drafts make no step of {rows} rows")
    order = np.random.default_rng(0).permutation(len(drafts.accepted))[: steps * rows]
    return drafts.probability[order], drafts.accepted[order]
