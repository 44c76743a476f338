"""Hypothesis strategies for fragmented page lists and buffer layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

PAGE_SHAPES = ("random", "contiguous", "fragmented", "single", "empty")


def fragmented_pages(rng: np.random.Generator, num_pages: int, mean_run: float) -> np.ndarray:
    """Distinct pages in runs of geometric length, runs placed in shuffled order."""
    if num_pages == 0:
        return np.zeros(0, dtype=np.int64)
    lengths = rng.geometric(1.0 / mean_run, size=num_pages)
    num_runs = int(np.searchsorted(np.cumsum(lengths), num_pages)) + 1
    lengths = lengths[:num_runs]
    lengths[-1] -= lengths.sum() - num_pages
    gapped_starts = np.cumsum(lengths + 1) - (lengths + 1)  # one free page after each run
    order = rng.permutation(num_runs)
    run_of_page = np.repeat(order, lengths[order])
    page_in_run = np.arange(num_pages) - np.repeat(
        np.cumsum(lengths[order]) - lengths[order], lengths[order]
    )
    return gapped_starts[run_of_page] + page_in_run


@st.composite
def page_lists(draw, max_pages: int = 300) -> dict[str, np.ndarray]:
    """src, host dst and device dst page lists of one request (equal lengths)."""
    shape = draw(st.sampled_from(PAGE_SHAPES))
    num_pages = {"empty": 0, "single": 1}.get(shape, draw(st.integers(2, max_pages)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = draw(st.sampled_from([0, 7, 2**20, 2**31 - 2 * max_pages - 2]))
    mean_run = draw(st.sampled_from([1.5, 4.0, 16.0]))
    return {
        name: base + _pages_of_shape(shape, rng, num_pages, mean_run)
        for name in ("src", "dst", "device")
    }


def _pages_of_shape(
    shape: str, rng: np.random.Generator, num_pages: int, mean_run: float
) -> np.ndarray:
    if shape == "contiguous":
        return np.arange(num_pages, dtype=np.int64)
    if shape == "fragmented":  # every page its own run: even pages, shuffled
        return 2 * rng.permutation(num_pages).astype(np.int64)
    return fragmented_pages(rng, num_pages, mean_run)


@st.composite
def layouts(draw, max_buffers: int = 6) -> dict[str, list]:
    """Buffer pointers near 2**47, item lengths, and each buffer's destination space."""
    num_buffers = draw(st.integers(0, max_buffers))
    top = 2**47
    item_lens = draw(st.lists(st.integers(1, 2**16), min_size=num_buffers, max_size=num_buffers))
    src_ptrs = [top - draw(st.integers(0, 2**20)) * 4096 for _ in range(num_buffers)]
    dst_ptrs = [top + draw(st.integers(0, 2**20)) * 4096 for _ in range(num_buffers)]
    dst_is_device = draw(st.lists(st.booleans(), min_size=num_buffers, max_size=num_buffers))
    return {
        "src_ptrs": src_ptrs,
        "dst_ptrs": dst_ptrs,
        "item_lens": item_lens,
        "dst_is_device": dst_is_device,
    }
