"""The shared fragmented-page generator: distinct pages, runs of the asked mean, inside the pool."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_planner.testing import fragmented_pages


def _num_runs(pages: np.ndarray) -> int:
    return int(np.count_nonzero(np.diff(pages) != 1)) + 1


@pytest.mark.parametrize("mean_run", [1.0, 3.0, 16.0])
def test_pages_are_distinct_runs_of_the_requested_mean(mean_run):
    pages = fragmented_pages(20_000, mean_run, np.random.default_rng(3))

    assert len(np.unique(pages)) == len(pages) == 20_000
    assert len(pages) / _num_runs(pages) == pytest.approx(mean_run, rel=0.15)
    assert np.array_equal(pages, fragmented_pages(20_000, mean_run, np.random.default_rng(3)))


@given(
    num_pages=st.integers(0, 500),
    extra_pages=st.integers(0, 500),
    mean_run=st.floats(1.0, 32.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_pages_fit_the_pool(num_pages, extra_pages, mean_run, seed):
    pool_pages = num_pages + extra_pages
    pages = fragmented_pages(num_pages, mean_run, np.random.default_rng(seed), pool_pages)

    assert len(np.unique(pages)) == len(pages) == num_pages
    assert pages.size == 0 or (pages.min() >= 0 and pages.max() < pool_pages)


def test_a_request_larger_than_its_pool_is_refused():
    with pytest.raises(ValueError, match="a request of 10 pages does not fit a pool of 9"):
        fragmented_pages(10, 2.0, np.random.default_rng(0), pool_pages=9)


def test_dtype_is_the_asked_one():
    assert fragmented_pages(64, 4.0, np.random.default_rng(0), dtype=np.int32).dtype == np.int32
