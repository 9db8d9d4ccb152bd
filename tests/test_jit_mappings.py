"""Warm-up against the process's memory-mapping limit (jaxinfer/jit_mappings.py)."""

from __future__ import annotations

import sys

import pytest

from jaxinfer import jit_mappings
from jaxinfer.jit_mappings import MappingBudget, MappingLimitError


def _fake_system(monkeypatch, counts: list[int], limit: int) -> None:
    it = iter(counts)
    monkeypatch.setattr(jit_mappings, "mapping_count", lambda: next(it))
    monkeypatch.setattr(jit_mappings, "mapping_limit", lambda: limit)


def test_budget_projects_the_mean_program_over_the_rest(monkeypatch):
    # 1,000 held at the start; programs of 800 then 900 mappings; a limit of 10,000 less 10% headroom.
    _fake_system(monkeypatch, [1_000, 1_800, 2_700], limit=10_000)
    budget = MappingBudget(num_programs=10)
    budget.check(1)  # 1,800 + 9 x 800 = 9,000: at the line, not past it
    with pytest.raises(MappingLimitError, match=r"vm\.max_map_count.*--max-running"):
        budget.check(2)  # 2,700 + 8 x 850 = 9,500
    assert budget.per_program == 850


def test_budget_passes_when_the_last_program_fits(monkeypatch):
    _fake_system(monkeypatch, [1_000, 5_000, 9_500], limit=10_000)
    budget = MappingBudget(num_programs=2)
    budget.check(1)  # 5,000 + 4,000 = 9,000
    budget.check(2)  # nothing left to compile: past the headroom, but every program is in


def test_budget_does_nothing_where_the_system_does_not_say(monkeypatch):
    monkeypatch.setattr(jit_mappings, "mapping_limit", lambda: None)
    monkeypatch.setattr(jit_mappings, "mapping_count", lambda: pytest.fail("read without a limit"))
    MappingBudget(num_programs=5).check(1)


def test_the_real_counts_are_read_where_the_system_has_them():
    count, limit = jit_mappings.mapping_count(), jit_mappings.mapping_limit()
    if sys.platform.startswith("linux"):
        assert limit is not None and 0 < count < limit
    else:  # no /proc: the budget stands aside
        assert count is None and limit is None
