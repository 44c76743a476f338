"""The CPU backend's three expansion strategies each equal the reference."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pages_strategies import layouts, page_lists
from test_plan import BATCH_LIMITS, expected_batches, plan

from gpu_planner import cpu_backend

STRATEGIES = {
    "in-place": {"_MIN_IN_PLACE_BLOCK": 0},
    "concatenate": {"_MIN_IN_PLACE_BLOCK": 10**18, "_MAX_CONCATENATED_PIECES": 10**9},
    "scatter": {"_MIN_IN_PLACE_BLOCK": 10**18, "_MAX_CONCATENATED_PIECES": 0},
}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def strategy(request):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in STRATEGIES[request.param].items():
            patch.setattr(cpu_backend, name, value)
        yield request.param


@given(pages=page_lists(), layout=layouts(), max_batch_pages=st.sampled_from(BATCH_LIMITS))
def test_each_expansion_strategy_matches_reference(strategy, pages, layout, max_batch_pages):
    result = plan(pages, layout, max_batch_pages, "cpu", "cpu")
    assert list(result.batches()) == expected_batches(pages, layout, max_batch_pages)
