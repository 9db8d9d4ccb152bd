"""Draft thresholds chosen from the heads' held-out drafts and a machine's step costs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxinfer.speculation.thresholds import (
    GRID,
    HeldOutDrafts,
    best_thresholds,
    modeled_speed,
    num_drafts,
    step_cost,
)


def _drafts(n: int = 3000, depth: int = 3, seed: int = 0) -> HeldOutDrafts:
    """Heads whose drafts are right about as often as they are sure, depth after depth."""
    rng = np.random.default_rng(seed)
    probability = rng.beta(1.2, 1.5, size=(n, depth)).astype(np.float32)
    right = rng.random((n, depth)) < probability * 0.9
    return HeldOutDrafts(probability, np.sum(np.cumprod(right, axis=1), axis=1))


def test_num_drafts_stops_at_the_first_unsure_depth():
    drafts = HeldOutDrafts(
        np.array([[0.9, 0.1, 0.9], [0.9, 0.9, 0.9], [0.05, 0.9, 0.9]]), np.array([1, 3, 0])
    )
    assert num_drafts(drafts, (0.5,)).tolist() == [1, 3, 0]
    assert num_drafts(drafts, (0.5, 0.05, 0.95)).tolist() == [2, 2, 0]  # the last threshold holds deeper
    # Drafts verified [1, 3, 0] accept [1, 3, 0]: 5 + 3 tokens over the costs of 1, 3 and 0 drafts.
    assert modeled_speed(drafts, (0.5,), (1.0, 1.1, 1.2, 1.5)) == pytest.approx(7 / (1.1 + 1.5 + 1.0))


def test_best_thresholds_is_the_best_of_every_combination():
    drafts = _drafts()
    for costs in [(1.05, 1.1, 1.2, 1.4), (1.0, 1.6, 2.3, 3.1), (1.1, 1.12, 1.6, 1.7)]:
        chosen, speed = best_thresholds(drafts, costs)
        every = {t: modeled_speed(drafts, t, costs) for t in itertools.product(GRID, repeat=3)}
        assert speed == pytest.approx(max(every.values()), rel=1e-9)
        assert modeled_speed(drafts, chosen, costs) == pytest.approx(speed, rel=1e-9)


def test_steps_of_several_rows_pay_for_their_longest_row():
    """With several rows a step verifies its longest row of drafts and each row pays that width: the
    search over such steps is still the best of every combination, and it chooses differently from
    one row's."""
    drafts = _drafts(seed=2)
    costs = (1.02, 1.3, 1.6, 2.0)
    one, one_speed = best_thresholds(drafts, costs)
    four, four_speed = best_thresholds(drafts, costs, rows=4)
    every = {t: modeled_speed(drafts, t, costs, rows=4) for t in itertools.product(GRID, repeat=3)}
    assert four_speed == pytest.approx(max(every.values()), rel=1e-9)
    assert four_speed < one_speed
    # Four rows of drafts rarely all stop short, so a step mostly pays for a first draft anyway: the
    # one-row thresholds, priced at four rows, do worse than those chosen for them.
    assert one != four and modeled_speed(drafts, one, costs, rows=4) < four_speed
    # Rows of one step: the width is the longest row's, so a step of a sure row and an unsure one
    # costs the sure row's width for both.
    pair = HeldOutDrafts(np.array([[0.9, 0.9, 0.9], [0.01, 0.01, 0.01]]), np.array([3, 0]))
    assert modeled_speed(pair, (0.5,), (1.0, 1.5, 2.0, 2.5), rows=2) == pytest.approx((4 + 1) / (2 * 2.5))
    with pytest.raises(ValueError, match="no step"):
        best_thresholds(pair, costs, rows=3)


def test_step_costs_never_fall_with_more_drafts_and_carry_the_heads():
    """A noisy measurement saying more drafts cost less is read as the cheaper width's cost; the heads
    run one depth past the longest row's drafts, up to their depth."""
    cost = step_cost((1.05, 1.3, 1.2, 1.25), head_cost=0.04, depth=3)
    np.testing.assert_allclose(cost, [1.05 + 0.04, 1.3 + 0.08, 1.3 + 0.12, 1.3 + 0.12])
    drafts = _drafts(seed=3)
    free, _ = best_thresholds(drafts, (1.0, 1.0, 1.0, 1.0))
    heads_cost, _ = best_thresholds(drafts, (1.0, 1.0, 1.0, 1.0), head_cost=0.1)
    assert free == (GRID[0],) * 3  # drafts that cost nothing: draft everything
    assert heads_cost != free  # running a head deeper for an unlikely draft now costs


def test_dearer_drafts_need_surer_heads():
    """Where a draft costs little, the heads draft at low odds; where it costs nearly a step, only
    their surest drafts pay; a third draft dearer than the others needs more certainty than they do."""
    drafts = _drafts(seed=1)
    cheap, _ = best_thresholds(drafts, (1.0, 1.03, 1.07, 1.12))
    dear, _ = best_thresholds(drafts, (1.0, 1.6, 2.2, 2.8))
    deep, _ = best_thresholds(drafts, (1.0, 1.03, 1.07, 1.6))
    assert all(a <= b for a, b in zip(cheap, dear)) and sum(cheap) < sum(dear)
    assert cheap[0] <= 0.1 and dear[0] >= 0.5
    assert deep[2] > cheap[2] and deep[2] > deep[1]


def test_held_out_drafts_round_trip_and_checks(tmp_path):
    drafts = _drafts(n=50, depth=2)
    drafts.save(tmp_path)
    loaded = HeldOutDrafts.load(tmp_path)
    np.testing.assert_array_equal(loaded.accepted, drafts.accepted)
    np.testing.assert_allclose(loaded.probability, drafts.probability, atol=1e-3)  # kept as float16
    assert HeldOutDrafts.load(tmp_path / "none") is None
    with pytest.raises(ValueError):
        HeldOutDrafts(np.full((4, 2), 0.5), np.array([0, 1, 3, 1]))  # 3 accepted of 2 drafts
    with pytest.raises(ValueError):
        HeldOutDrafts(np.full((4, 2), 0.5), np.zeros(3))
    with pytest.raises(ValueError, match="step costs"):
        best_thresholds(drafts, (1.0, 1.1, 1.2, 1.3))  # 2 deep: costs of 0..2 drafts
